"""Prompt datasets: readers for the PACS dataset shapes, the PACS prompt, the canonical row format."""

from megatron_pacs.data.formats import BadRowError, read_prompt_rows, read_records, to_prompt_row, write_rows
from megatron_pacs.data.prepare import PrepareReport, filter_by_prompt_length, prepare_dataset
from megatron_pacs.data.prompts import INSTRUCTION, PromptRow, apply_chat_template, build_messages

__all__ = [
    "INSTRUCTION",
    "BadRowError",
    "PrepareReport",
    "PromptRow",
    "apply_chat_template",
    "build_messages",
    "filter_by_prompt_length",
    "prepare_dataset",
    "read_prompt_rows",
    "read_records",
    "to_prompt_row",
    "write_rows",
]
