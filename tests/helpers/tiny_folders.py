"""A tiny Hugging Face model folder (fp32 Qwen2, its byte-level BPE tokenizer) and a prepared data file, built in a
few seconds: what the start-of-run refusal tests and the evaluate tool's tests point their flags at."""

from pathlib import Path


def make_model(path: Path, *, layers: int = 2, hidden: int = 64, vocab_size: int = 512) -> Path:
    """``save_pretrained`` of a random tiny Qwen2 with the demo's tokenizer (``vocab_size`` tokens) into ``path``."""
    from megatron_pacs.demo.tiny import arithmetic_corpus, build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=vocab_size, corpus=arithmetic_corpus(2000))  # a second, not 10 on 20,000 lines
    config = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=hidden, layers=layers, heads=4, kv_heads=2)
    build_tiny_model(str(path), config, seed=0, tokenizer=tok)
    return path


def make_problems(path: Path, num: int = 8, *, data_source: str = "arith") -> Path:
    """``num`` arithmetic problems of ``data_source`` in the canonical format at ``path``."""
    from megatron_pacs.data.formats import write_rows
    from megatron_pacs.data.prompts import PromptRow, build_messages

    path.parent.mkdir(parents=True, exist_ok=True)
    questions = [(f"What is {i} + {i + 1}?", str(2 * i + 1)) for i in range(num)]
    rows = [
        PromptRow(id=str(i), data_source=data_source, prompt=build_messages(q), ground_truth=a, question=q)
        for i, (q, a) in enumerate(questions)
    ]
    write_rows(rows, path)
    return path
