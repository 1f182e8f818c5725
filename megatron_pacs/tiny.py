"""Tiny local tokenizers and models for tests and the CPU demo: built in seconds, no hub downloads.

``build_tokenizer`` trains a byte-level BPE on generated arithmetic text and wraps it as a
``PreTrainedTokenizerFast`` with a ChatML template (the Qwen2 chat format), so the real loading code
(``AutoTokenizer.from_pretrained``, ``apply_chat_template``) runs unchanged on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "arithmetic_corpus", "build_tokenizer"]

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


def build_tokenizer(vocab_size: int = 2048, seed: int = 0) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and chat template.

    Args:
        vocab_size: Target vocabulary size (specials included).
        seed: Seed of the training corpus.

    Returns:
        The tokenizer; ``eos_token`` is ``<|im_end|>``, ``pad_token`` is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_corpus(seed=seed), trainer=trainer)
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
