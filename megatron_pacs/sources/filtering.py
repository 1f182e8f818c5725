"""Dynamic sampling (``--filter-groups zero-variance``, DAPO): drop the groups whose rewards are all equal and refill
the batch from the prompt stream, so every step trains on ``--global-batch-size`` groups.

On the driver, around the source's ``collect``: the step's prompts are generated and scored; the groups left with
unequal rewards are kept; while fewer than the batch's are, the next prompts of the stream (exactly as many as are
missing) are generated and scored in a refill round, at most ``--max-filter-rounds`` rounds (0: no limit; past
them the step fails, as verl's ``max_num_gen_batches``). Each prompt drawn is trained once or dropped once: the
stream's position (the loader's, which checkpoints save) is past every prompt a step used, its dropped ones too, so
a resume neither repeats nor skips one. What a dropped group would have contributed: docs/algorithm.md §2.8.

Legend: P prompts of the step, n group size, S = P * n responses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources.base import StepRollouts, rollout_metrics
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.run_failure import RunFailure

__all__ = ["Collect", "GroupFilter", "Refill", "select_groups", "zero_variance_groups"]

log = get_logger("filtering")

Refill = Callable[[int], list[PromptRow]]
"""``refill(k)``: the next ``k`` prompts of the step's stream (the prompt loader's ``next_batch``)."""


class Collect(Protocol):
    """A rollout source's ``collect``."""

    def __call__(self, rows: Sequence[PromptRow], step: int, *, refill: int = 0) -> StepRollouts: ...


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups' rewards are all equal.

    Args:
        rewards: ``[S]`` rewards, groups contiguous.
        group_size: n.

    Returns:
        ``[P]`` bool.
    """
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def select_groups(parts: Sequence[tuple[StepRollouts, Sequence[int]]]) -> StepRollouts:
    """The chosen groups of several rollouts (all responses held, one group size), in order, as one.

    Args:
        parts: ``(rollouts, groups)``: the indices of the groups to keep from each.

    Returns:
        Their batch, records, prompt ids and finish reasons; no metrics.
    """
    n = parts[0][0].batch.group_size
    tokens, routed, engine, picked = [], [], [], []
    records: list[dict[str, Any]] = []
    prompt_ids: list[str] = []
    finish: list[str] = []
    for rollouts, groups in parts:
        b = rollouts.batch
        responses = [g * n + j for g in groups for j in range(n)]
        eo = b.engine_offsets
        for i in responses:
            tokens.append(b.sequence(i))
            if b.engine_logprobs is not None:
                engine.append(b.engine_logprobs[int(eo[i]) : int(eo[i + 1])])
            if b.routed_experts is not None:
                routed.append(b.routed_experts[int(b.offsets[i]) : int(b.offsets[i + 1])])
        picked.append((b, responses))
        prompt_ids += [rollouts.prompt_ids[g] for g in groups]
        records += [rollouts.records[i] for i in responses] if rollouts.records else []
        finish += [rollouts.finish_reasons[i] for i in responses] if rollouts.finish_reasons else []
    first = parts[0][0].batch
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    offsets = torch.zeros(len(tokens) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)

    def field(name: str) -> torch.Tensor:
        return torch.cat([getattr(b, name)[idx] for b, idx in picked])

    batch = RolloutBatch(
        torch.cat(tokens) if tokens else first.token_ids[:0],
        offsets,
        field("prompt_lens"),
        field("response_lens"),
        field("rewards"),
        n,
        torch.cat(engine) if first.engine_logprobs is not None and engine else None,
        torch.cat(routed) if first.routed_experts is not None and routed else None,
    )
    return StepRollouts(batch, records, {}, prompt_ids=prompt_ids, finish_reasons=finish)


class GroupFilter:
    """``--filter-groups zero-variance`` around a source's ``collect`` (the driver's producer calls it).

    Args:
        batch_prompts: The groups a step trains on (``--global-batch-size``).
        max_rounds: Refill rounds after the first generation (``--max-filter-rounds``; 0: no limit).
    """

    def __init__(self, *, batch_prompts: int, max_rounds: int) -> None:
        self.batch_prompts, self.max_rounds = batch_prompts, max_rounds

    @classmethod
    def from_config(cls, cfg: Any) -> GroupFilter | None:
        """The run's filter (a ``TrainConfig``), or None with ``--filter-groups none``."""
        if cfg.source.filter_groups == "none":
            return None
        return cls(batch_prompts=cfg.batch.global_batch_size, max_rounds=cfg.source.max_filter_rounds)

    def __call__(self, collect: Collect, rows: Sequence[PromptRow], step: int, refill: Refill | None) -> StepRollouts:
        """Step ``step``'s rollouts from ``rows``, their zero-variance groups replaced by groups of refill prompts.

        Args:
            collect: The source's ``collect``; refill round r calls it with ``refill=r``.
            rows: The step's prompts.
            step: The training step.
            refill: The prompt stream the refill prompts come from (None: the step cannot refill, and fails if it
                has to).

        Returns:
            ``--global-batch-size`` groups with unequal rewards, with the metrics ``rollout/filtered_groups`` (groups
            dropped), ``rollout/filter_rounds`` (refill rounds run) and ``rollout/reward_mean_unfiltered`` (over
            every response generated); ``rollout/*`` describe the batch trained on.

        Without a limit (``--max-filter-rounds 0``) the step says that it is still refilling after 8, 16, 32, ...
        rounds, with how many groups it holds.

        Raises:
            RunFailure: The groups are still short after ``--max-filter-rounds`` rounds (naming the flag), or the
                step cannot refill.
        """
        rollouts = collect(rows, step)
        parts, rounds = [], 0
        while True:
            dropped = zero_variance_groups(rollouts.batch.rewards, rollouts.batch.group_size)
            parts.append((rollouts, [g for g, d in enumerate(dropped.tolist()) if not d]))
            missing = self.batch_prompts - sum(len(kept) for _, kept in parts)
            if missing <= 0:
                break
            if refill is None or (self.max_rounds and rounds == self.max_rounds):
                raise RunFailure(
                    f"step {step}: --filter-groups zero-variance: {self.batch_prompts - missing} of "
                    f"{self.batch_prompts} groups have unequal rewards after {rounds} refill rounds "
                    f"(--max-filter-rounds {self.max_rounds}); look at the rewards (a policy that solves every "
                    "prompt, or none, leaves no group to train on: rollout/reward_mean_unfiltered), or raise "
                    "--max-filter-rounds"
                )
            if not self.max_rounds and rounds >= 8 and rounds & (rounds - 1) == 0:
                log.warning(
                    "step %d: --filter-groups zero-variance: still refilling after %d rounds, %d of %d groups with "
                    "unequal rewards so far (--max-filter-rounds 0: no limit; a policy that solves every prompt, or "
                    "none, never fills the step)",
                    step,
                    rounds,
                    self.batch_prompts - missing,
                    self.batch_prompts,
                )
            rounds += 1
            rollouts = collect(refill(missing), step, refill=rounds)
        return self._merged(parts, rounds)

    def _merged(self, parts: list[tuple[StepRollouts, list[int]]], rounds: int) -> StepRollouts:
        """One step's rollouts from its rounds: the kept groups, every round's counters and times summed."""
        generated = [r for r, _ in parts]
        filtered = sum(r.batch.num_prompts - len(kept) for r, kept in parts)
        if filtered == 0:
            out = parts[0][0]
        else:
            out = select_groups(parts)
            for rollouts in generated:  # the source's own counters and times (reward/*, perf/time/*) add up
                for key, value in rollouts.metrics.items():
                    if not key.startswith("rollout/"):
                        out.metrics[key] = out.metrics.get(key, 0.0) + value
            empty = sum(r.metrics.get("rollout/empty_responses", 0.0) for r in generated)
            out.metrics.update(rollout_metrics(out.batch, out.finish_reasons, empty_responses=int(empty)))
        rewards = torch.cat([r.batch.rewards for r in generated])
        out.metrics["rollout/filtered_groups"] = float(filtered)
        out.metrics["rollout/filter_rounds"] = float(rounds)
        out.metrics["rollout/reward_mean_unfiltered"] = float(rewards.float().mean())
        return out
