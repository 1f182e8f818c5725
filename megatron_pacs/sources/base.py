"""What every rollout source hands the trainer, and the protocol a source implements.

Legend: P prompts of the step, n group size, S = P * n responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.prompts import PromptRow

__all__ = ["RolloutSource", "StepRollouts", "rollout_metrics"]


@dataclass
class StepRollouts:
    """A step's rollouts on the driver: what it distributes to the ranks, dumps and reports.

    Attributes:
        batch: The packed batch (all S responses, groups contiguous, with the engines' token log-probs when the
            source has them).
        records: One readable record per response (prompt, response text, ground truth, score) for the text dump.
        metrics: The step's rollout metrics (``rollout/*``, ``reward/*``, and the source's own ``perf/time/*``).
        prompt_ids: ``[P]`` the prompts' data-set ids, in group order.
        finish_reasons: ``[S]`` why each response ended (``stop``, ``length``, ...), when the source knows.
        token_versions: ``[sum R_i]`` int32, the weights' version that sampled each response token
            (``--max-staleness``; the engine log-probs' layout), or None.
    """

    batch: RolloutBatch
    records: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_ids: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    token_versions: torch.Tensor | None = None


class RolloutSource(Protocol):
    """Turns a step's prompts into its rollouts, on the driver (global rank 0) only.

    A source is registered in :mod:`megatron_pacs.config.sources` (what it can do, declared there) and built by
    its ``open(cfg, *, tokenizer, log_dir, context)`` classmethod.

    Attributes:
        fleet: The engines it generates with (the weight sync, the sync probe, validation and the fault counters use
            them), or None.
        scorer: The reward pool it scores with (validation uses it), or None.
    """

    fleet: Any
    scorer: Any

    def check(self, steps: Sequence[int]) -> None:
        """Refuse, before the steps run, input that cannot give steps ``steps``' rollouts (naming the file/flag)."""
        ...

    def collect(self, rows: Sequence[PromptRow], step: int, *, refill: int = 0) -> StepRollouts:
        """Step ``step``'s rollouts for the loader's ``rows`` (``global_batch_size`` prompts), or with ``refill`` r > 0
        those of refill round r (``--filter-groups``: more prompts for the same step), whose random draws (sampling
        seeds, synthetic rollouts) must not repeat round 0's."""
        ...

    def close(self) -> None:
        """Release what the source holds (engines, worker pools, files)."""
        ...


def rollout_metrics(batch: RolloutBatch, finish_reasons: Sequence[str], *, empty_responses: int) -> dict[str, float]:
    """The rollout metrics every source reports: the mean reward, lengths, the share of responses cut at
    ``--max-response-length`` (finish reason ``length``), empty responses, and the step's tokens.

    Args:
        batch: The step's rollouts (all S responses).
        finish_reasons: ``[S]`` why each response ended (empty when the source does not know).
        empty_responses: Responses with no token at all (each still scores one end-of-sequence token).
    """
    lens = batch.response_lens.float()
    clipped = sum(reason == "length" for reason in finish_reasons)
    return {
        "rollout/reward_mean": float(batch.rewards.mean()),
        "rollout/response_len_mean": float(lens.mean()),
        "rollout/response_len_max": float(lens.max()),
        "rollout/clip_ratio": clipped / batch.num_responses,
        "rollout/empty_responses": float(empty_responses),
        "rollout/prompt_len_mean": float(batch.prompt_lens.float().mean()),
        "rollout/num_tokens": float(batch.lengths.sum()),
    }
