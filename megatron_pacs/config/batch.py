"""Batch arithmetic: prompts per step, responses per prompt, mini-batches, micro-batches and lengths."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad

__all__ = ["BatchConfig"]


@dataclass(kw_only=True)
class BatchConfig:
    """Batch arithmetic; sizes in prompts unless they say responses or tokens."""

    global_batch_size: int = 16
    """Prompts per training step (each sampled --group-size times)."""
    group_size: int = 8
    """Responses per prompt (n)."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step; global-batch-size / ppo-mini-batch-size optimizer steps per epoch."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    micro_batch_size: int = 8
    """Padded layout: responses per micro-batch (when --max-tokens-per-microbatch is not given). Packed layout:
    the default token budget is this many sequences of --seq-length."""
    max_tokens_per_microbatch: int | None = None
    """Token budget per micro-batch: packed, the tokens of its sequences; padded, rows x longest row. Micro-batches
    may split groups (exact, docs/algorithm.md §3)."""
    sequence_packing: bool = True
    """Pack each micro-batch's sequences into one row without padding (Megatron's thd format; varlen attention);
    --no-sequence-packing gives one right-padded row per sequence."""
    keep_groups_in_microbatch: bool = False
    """Keep whole groups per micro-batch (the reference layout; the loss then runs directly with autograd)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (longer prompts are dropped from the data and counted)."""
    max_response_length: int = 1024
    """Maximum new tokens per response."""
    seq_length: int | None = None
    """Longest prompt + response; default max-prompt-length + max-response-length."""

    def __post_init__(self) -> None:
        positive = ("global_batch_size", "ppo_mini_batch_size", "ppo_epochs", "micro_batch_size")
        for name in (*positive, "max_prompt_length", "max_response_length"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.group_size < 2:
            raise bad("group_size", "PACS and GRPO compare responses within a group: use >= 2")
        if self.global_batch_size % self.ppo_mini_batch_size:
            raise bad(
                "ppo_mini_batch_size",
                f"{self.ppo_mini_batch_size} must divide --global-batch-size {self.global_batch_size}",
            )
        if self.seq_length is None:
            self.seq_length = self.max_prompt_length + self.max_response_length
        if self.seq_length < self.max_prompt_length + self.max_response_length:
            raise bad("seq_length", f"{self.seq_length} < max-prompt-length + max-response-length; raise it")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < self.seq_length:
            raise bad(
                "max_tokens_per_microbatch",
                f"{self.max_tokens_per_microbatch} cannot hold one sequence of --seq-length {self.seq_length}; "
                "raise it",
            )
        if (
            self.sequence_packing
            and self.keep_groups_in_microbatch
            and self.max_tokens_per_microbatch is not None
            and self.max_tokens_per_microbatch < self.group_size * self.seq_length
        ):
            raise bad(
                "max_tokens_per_microbatch",
                f"{self.max_tokens_per_microbatch} cannot hold a whole group of {self.group_size} sequences of "
                f"--seq-length {self.seq_length} with --keep-groups-in-microbatch; raise it to at least "
                f"{self.group_size * self.seq_length}",
            )
        if self.keep_groups_in_microbatch and self.micro_batch_size % self.group_size:
            raise bad(
                "micro_batch_size",
                f"{self.micro_batch_size} must be a multiple of --group-size {self.group_size} with "
                "--keep-groups-in-microbatch",
            )

    @property
    def packing_budget(self) -> int:
        """Tokens per packed micro-batch: --max-tokens-per-microbatch, else --micro-batch-size x --seq-length."""
        assert self.seq_length is not None  # filled in by __post_init__
        return self.max_tokens_per_microbatch or self.micro_batch_size * self.seq_length
