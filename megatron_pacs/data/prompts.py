"""The PACS prompt (docs/algorithm.md §8.1) and the canonical row every dataset is converted to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["INSTRUCTION", "PromptRow", "apply_chat_template", "build_messages"]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def build_messages(question: str) -> list[dict[str, str]]:
    """The question, one space, the instruction, as a single user message (no system message)."""
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return list(out)


@dataclass(kw_only=True)
class PromptRow:
    """One training or evaluation problem in the canonical format (one JSON object per line).

    Attributes:
        id: Unique within its data source.
        data_source: The dataset name metrics are grouped by (e.g. ``math500``).
        prompt: Chat messages, ``[{"role": "user", "content": question + " " + INSTRUCTION}]``.
        ground_truth: The final answer the reward compares against (wrapped in ``\\boxed{}`` there).
        question: The raw question text.
        extra_info: Anything else the source row carried (solution, level, ...).
    """

    id: str
    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: str
    question: str
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError("question is empty")
        if not self.ground_truth.strip():
            raise ValueError("ground_truth is empty")
        if not self.prompt or not all(isinstance(m, dict) and "content" in m for m in self.prompt):
            raise ValueError("prompt must be a non-empty list of {'role', 'content'} messages")

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-ready dict."""
        return asdict(self)
