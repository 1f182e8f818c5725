"""A Hugging Face model folder's tokenizer, checked before anything is built (no megatron, no engine).

transformers loads a folder that lacks ``tokenizer.json`` (a partial copy or download) without a word: it builds a
tokenizer of its special tokens alone, which encodes every text to nothing, and a run then trains on empty prompts.
:func:`load_checked_tokenizer` refuses such a folder naming it and the missing files, and refuses a tokenizer whose
vocabulary is far smaller than the model's, that encodes a prompt to nothing, or that has no chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "load_checked_tokenizer"]

TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
"""The files a tokenizer is built from, any one set of them: fast (``tokenizer.json``), byte-level BPE, SentencePiece,
WordPiece."""

#: A question every tokenizer of a text model encodes to tokens (the prompt of the PACS protocol around it).
PROBE = "What is 12 + 30?"


def load_checked_tokenizer(hf_dir: str | os.PathLike, flag: str = "--hf-model") -> Any:
    """The folder's tokenizer (``AutoTokenizer.from_pretrained``), after checking that it can encode prompts.

    Args:
        hf_dir: A Hugging Face model folder (config.json, tokenizer files, weights).
        flag: The flag that named the folder, for the messages.

    Returns:
        The tokenizer.

    Raises:
        ValueError: naming the flag, the folder and what is missing or wrong: no tokenizer files, a tokenizer that
            transformers cannot load, a vocabulary under half the model's ``vocab_size``, a text encoded to no
            token, no chat template.
    """
    from megatron_pacs.data.prompts import apply_chat_template, build_messages

    folder = Path(hf_dir)
    where = f"{flag} {folder}"
    if not any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILES):
        present = sorted(p.name for p in folder.glob("*token*")) if folder.is_dir() else []
        raise ValueError(
            f"{where} holds no tokenizer: tokenizer.json is missing (nor vocab.json + merges.txt, tokenizer.model or "
            f"vocab.txt; present: {', '.join(present) or 'no tokenizer file'}); a partial copy or download? Copy the "
            "model's tokenizer files into it"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise ValueError(f"{where}: its tokenizer does not load ({type(exc).__name__}: {exc})") from None
    vocab_size = _model_vocab_size(folder)
    if vocab_size is not None and 2 * len(tokenizer) < vocab_size:
        raise ValueError(
            f"{where}: its tokenizer has {len(tokenizer)} tokens, the model's vocab_size is {vocab_size} "
            "(config.json): the tokenizer files belong to another model or are damaged; copy the model's own "
            "tokenizer files"
        )
    if not tokenizer.encode(PROBE, add_special_tokens=False):
        raise ValueError(
            f"{where}: its tokenizer encodes the text {PROBE!r} to no token (damaged tokenizer files?); copy the "
            "model's own tokenizer files"
        )
    try:
        apply_chat_template(tokenizer, build_messages(PROBE))
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise their own types
        raise ValueError(
            f"{where}: its tokenizer has no usable chat template ({exc}); prompts are built with it: copy the "
            "model's chat_template.jinja or tokenizer_config.json (an instruct model's) into the folder"
        ) from None
    return tokenizer


def _model_vocab_size(folder: Path) -> int | None:
    """``vocab_size`` from the folder's config.json (top level or ``text_config``), None where it has none."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None
