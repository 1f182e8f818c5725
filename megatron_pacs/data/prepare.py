"""Dataset preparation: source file in, canonical prompt file out (the library behind tools/prepare_data.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_pacs.config import DataConfig
from megatron_pacs.data.formats import read_prompt_rows, write_rows
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.utils.logging import get_logger

__all__ = ["PrepareReport", "filter_by_prompt_length", "load_prompts", "prepare_dataset"]

log = get_logger("data")


@dataclass
class PrepareReport:
    """What a preparation run did: rows written, malformed rows skipped, over-long prompts dropped."""

    num_written: int
    num_bad_skipped: int
    num_too_long: int
    output: str


def filter_by_prompt_length(
    rows: list[PromptRow], tokenizer: Any, max_prompt_length: int
) -> tuple[list[PromptRow], int]:
    """Drop rows whose chat-templated prompt (with the generation prompt) exceeds ``max_prompt_length`` tokens.

    Returns:
        ``(kept_rows, num_dropped)``.
    """
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be > 0 tokens")
    kept = [r for r in rows if len(apply_chat_template(tokenizer, r.prompt)) <= max_prompt_length]
    return kept, len(rows) - len(kept)


def load_prompts(
    data: DataConfig, tokenizer: Any, max_prompt_length: int
) -> tuple[list[PromptRow], dict[str, list[PromptRow]], int]:
    """A run's training rows and its validation rows per source, prompts over ``max_prompt_length`` dropped.

    Args:
        data: ``--train-data`` and ``--val-data`` files.
        tokenizer: The model's tokenizer (its chat template decides prompt lengths).
        max_prompt_length: ``--max-prompt-length``.

    Returns:
        ``(train_rows, {source: val_rows}, dropped)`` with the validation rows keyed by their ``data_source``
        (:func:`validation_sets`), and the number of training prompts dropped (the trainer
        reports it as ``data/dropped_prompts``).
    """
    dropped_train = 0

    def read(path: str) -> tuple[list[PromptRow], int]:
        rows, _ = read_prompt_rows(path)
        kept, dropped = filter_by_prompt_length(rows, tokenizer, max_prompt_length)
        if dropped:
            log.warning("%s: dropped %d prompts longer than --max-prompt-length %d", path, dropped, max_prompt_length)
        return kept, dropped

    train = []
    for path in data.train_data:
        kept, dropped = read(path)
        train += kept
        dropped_train += dropped
    val = validation_sets({path: read(path)[0] for path in data.val_data})  # two files of one source: refused
    return train, val, dropped_train


def prepare_dataset(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    data_source: str | None = None,
    skip_bad_rows: bool = False,
    tokenizer_dir: str | None = None,
    max_prompt_length: int | None = None,
) -> PrepareReport:
    """Convert ``input_path`` to the canonical format at ``output_path`` (``.jsonl`` or ``.parquet``).

    Args:
        input_path: Source file (see :mod:`megatron_pacs.data.formats` for the shapes).
        output_path: Destination; written atomically, the input is never modified.
        data_source: Name stored in every row (default: the input file's stem).
        skip_bad_rows: Skip and count malformed rows instead of failing on the first.
        tokenizer_dir: A Hugging Face tokenizer directory, for the prompt-length filter.
        max_prompt_length: Drop prompts longer than this many tokens (needs ``tokenizer_dir``).
    """
    if (tokenizer_dir is None) != (max_prompt_length is None):
        raise ValueError("--tokenizer and --max-prompt-length go together: give both to filter long prompts")
    if Path(output_path).resolve() == Path(input_path).resolve():
        raise ValueError(f"output {output_path} is the input file; choose another output path")
    rows, skipped = read_prompt_rows(input_path, data_source=data_source, skip_bad_rows=skip_bad_rows)
    too_long = 0
    if tokenizer_dir is not None and max_prompt_length is not None:  # both or neither (checked above)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        rows, too_long = filter_by_prompt_length(rows, tok, max_prompt_length)
    if not rows:
        raise ValueError(f"{input_path}: no rows left to write ({skipped} malformed, {too_long} too long)")
    write_rows(rows, output_path)
    return PrepareReport(len(rows), skipped, too_long, str(output_path))


def validation_sets(files: dict[str, list[PromptRow]]) -> dict[str, list[PromptRow]]:
    """Validation rows keyed by each row's ``data_source`` (the ``val/<source>/`` metrics), not by file name.

    Args:
        files: Each ``--val-data`` file's rows.

    Returns:
        ``{data_source: rows}``; a file of several sources gives several sets.

    Raises:
        ValueError: naming ``--val-data``, both files and the source, when two files hold rows of one source (one
            set would hide the other under the same metric).
    """
    sets: dict[str, list[PromptRow]] = {}
    origin: dict[str, str] = {}
    for path, rows in files.items():
        for row in rows:
            first = origin.setdefault(row.data_source, path)
            if first != path:
                raise ValueError(
                    f"--val-data: {first} and {path} both hold validation rows of data_source {row.data_source!r}, "
                    "and validation is logged per data_source (val/<source>/reward_mean); merge them into one file "
                    "or give each its own data_source (tools/prepare_data.py --data-source NAME)"
                )
            sets.setdefault(row.data_source, []).append(row)
    return sets
