"""The synthetic source: seeded random token sequences with an RL length mix and Bernoulli rewards.

For the training phase alone, at any scale and layout (``--rollout-source synthetic``): everything after generation
runs as with the fleet (the layout, old and reference log-probs, the loss, the optimizer, the weight export with its
gathers, checkpoints), with no engine, reward pool, Ray, vLLM or math-verify. The mix is that of
``benchmarks/bench_train_step.py``: prompts of about 200 tokens (normal, sd 40, within ``--max-prompt-length``),
responses log-normal (sigma 0.8, median 1,500 / 8,192 of ``--max-response-length``) with a long tail up to
``--max-response-length``, token ids uniform over the vocabulary above the first three, and each response's reward 1
with probability ``--synthetic-reward-rate``. A step's rollouts depend only on ``--seed``, the step and, with
``--filter-groups``, the refill round.

Legend: P prompts, n group size, S = P * n responses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_pacs.config import TrainConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources.base import StepRollouts, rollout_metrics
from megatron_pacs.sources.dumps import DumpContext
from megatron_pacs.utils.seeding import SYNTHETIC_STREAM, seed_sequence

__all__ = ["SyntheticSource", "synthetic_lengths"]

_MEDIAN_SHARE = 1500 / 8192  # bench_train_step.py's median response against its 8,192-token cap


def synthetic_lengths(
    rng: np.random.Generator, prompts: int, group_size: int, *, max_prompt: int, max_response: int
) -> list[tuple[int, int]]:
    """``(prompt_len, response_len)`` for every response, groups contiguous (see the module docstring).

    Returns:
        ``[S]`` pairs; a group's responses share its prompt's length.
    """
    out = []
    median = max(1.0, _MEDIAN_SHARE * max_response)
    for _ in range(prompts):
        p = int(min(max(rng.normal(200, 40), min(64, max_prompt)), max_prompt))
        for _ in range(group_size):
            r = int(min(max(rng.lognormal(math.log(median), 0.8), 1), max_response))
            out.append((max(p, 1), r))
    return out


class SyntheticSource:
    """Seeded synthetic rollouts of the run's batch shape (driver only).

    Args:
        cfg: The run's settings (batch shape, lengths, ``--seed``, ``--synthetic-reward-rate``).
        vocab_size: Token ids are drawn below this (the smaller of the tokenizer's and the model's vocabularies).
    """

    fleet = None
    scorer = None

    def __init__(self, cfg: TrainConfig, vocab_size: int) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size

    @classmethod
    def open(cls, cfg: TrainConfig, *, tokenizer: Any, log_dir: str, context: DumpContext) -> SyntheticSource:
        """Token ids stay within both the tokenizer's and the model's vocabularies."""
        return cls(cfg, min(context.tokenizer_size, context.vocab_size))

    def check(self, steps: Sequence[int]) -> None:
        """Nothing to check ahead: every step's rollouts are drawn from the seed."""

    def collect(self, rows: Sequence[PromptRow], step: int, *, refill: int = 0) -> StepRollouts:
        """Step ``step``'s rollouts, or its refill round ``refill``'s (``rows`` give only the prompts' ids; their
        texts are not used)."""
        started = time.perf_counter()
        b = self.cfg.batch
        rng = np.random.default_rng(seed_sequence(self.cfg.run.seed, SYNTHETIC_STREAM, step, *_round(refill)))
        mix = synthetic_lengths(
            rng, len(rows), b.group_size, max_prompt=b.max_prompt_length, max_response=b.max_response_length
        )
        total = sum(p + r for p, r in mix)
        tokens = torch.from_numpy(rng.integers(3, self.vocab_size, size=total, dtype=np.int64))
        rewards = torch.from_numpy((rng.random(len(mix)) < self.cfg.source.synthetic_reward_rate).astype(np.float32))
        lengths = torch.tensor([p + r for p, r in mix], dtype=torch.long)
        offsets = torch.zeros(len(mix) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        batch = RolloutBatch(
            token_ids=tokens,
            offsets=offsets,
            prompt_lens=torch.tensor([p for p, _ in mix], dtype=torch.long),
            response_lens=torch.tensor([r for _, r in mix], dtype=torch.long),
            rewards=rewards,
            group_size=b.group_size,
        )
        finish = ["length" if r == b.max_response_length else "stop" for _, r in mix]
        metrics = rollout_metrics(batch, finish, empty_responses=0)
        metrics["perf/time/synthesize"] = time.perf_counter() - started
        return StepRollouts(batch, metrics=metrics, prompt_ids=[row.id for row in rows], finish_reasons=finish)

    def close(self) -> None:
        """Nothing to release."""


def _round(refill: int) -> tuple[int, ...]:
    """The stream key of a refill round: none for round 0 (the stream of a run without --filter-groups)."""
    return (refill,) if refill else ()
