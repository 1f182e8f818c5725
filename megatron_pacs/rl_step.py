"""One RL step between the fleet and the actor: rollouts -> batch, then the update over mini-batches.

``collect_rollouts`` runs on the driver (rank 0): generate, score, pack. ``train_on_batch`` runs on every rank and
reads as the algorithm: the log-probs the objective needs, then per mini-batch ``prepare`` and one optimizer step.
What to compute is the objective's to say (:mod:`megatron_pacs.algo.objectives`); this module only schedules it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.metrics import reduce_metrics
from megatron_pacs.algo.objectives import MiniBatch, Objective
from megatron_pacs.config import BatchConfig, TrainConfig
from megatron_pacs.data.batching import RolloutBatch, micro_batch_rows, mini_batch_rows, pad_rows
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.forward import MicroBatch
from megatron_pacs.mcore.optim import StepResult
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.utils.metrics import PhaseTimer

__all__ = ["StepRollouts", "collect_rollouts", "train_on_batch"]


@dataclass
class StepRollouts:
    """What the driver broadcasts: the batch, the texts for the dump, and rollout metrics."""

    batch: RolloutBatch
    records: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def collect_rollouts(
    fleet: Any, scorer: Any, tokenizer: Any, rows: Sequence[PromptRow], cfg: TrainConfig, step: int, timer: PhaseTimer
) -> StepRollouts:
    """Driver only: sample ``group_size`` responses per prompt, score them, and pack the batch."""
    from megatron_pacs.rollout.types import SamplingConfig

    r, b = cfg.rollout, cfg.batch
    prompts = [apply_chat_template(tokenizer, row.prompt) for row in rows]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingConfig(
        n=b.group_size,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=b.max_response_length,
        seed=cfg.run.seed * 1_000_003 + step * 7919,
        stop_token_ids=eos,
        logprobs=False,
    )
    with timer.phase("generate"):
        groups = fleet.generate(prompts, sampling)
    with timer.phase("reward"):
        texts = [resp.text for g in groups for resp in g.responses]
        truths = [row.ground_truth for row in rows for _ in range(b.group_size)]
        scored = scorer.score(texts, truths)
    sequences, prompt_lens, response_lens, records, clipped = [], [], [], [], 0
    for row, prompt, g in zip(rows, prompts, groups, strict=True):
        for resp in g.responses:
            ids = list(resp.token_ids) or eos[:1] or [0]  # an empty response still needs one scored token
            sequences.append(prompt + ids)
            prompt_lens.append(len(prompt))
            response_lens.append(len(ids))
            clipped += resp.finish_reason == "length"
            records.append(
                {
                    "step": step,
                    "id": row.id,
                    "data_source": row.data_source,
                    "input": row.question,
                    "output": resp.text,
                    "ground_truth": row.ground_truth,
                }
            )
    for rec, score in zip(records, scored.scores, strict=True):
        rec["score"] = score
    rewards = torch.tensor(scored.scores, dtype=torch.float32)
    lens = torch.tensor(response_lens, dtype=torch.float32)
    batch = RolloutBatch(sequences, torch.tensor(prompt_lens), torch.tensor(response_lens), rewards, b.group_size)
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/response_len_mean": float(lens.mean()),
        "rollout/response_len_max": float(lens.max()),
        "rollout/clip_ratio": clipped / len(sequences),
        "rollout/prompt_len_mean": float(torch.tensor(prompt_lens, dtype=torch.float32).mean()),
        "rollout/num_tokens": float(sum(len(s) for s in sequences)),
        "reward/num_errors": float(scored.num_errors),
        "reward/num_timeouts": float(scored.num_timeouts),
        "reward/num_too_long": float(scored.num_too_long),
    }
    return StepRollouts(batch, records, metrics)


def micro_batches(
    batch: RolloutBatch, rows: list[int], cfg: BatchConfig, *, whole_groups: bool, uniform: bool
) -> list[MicroBatch]:
    """``rows`` cut into padded micro-batches by ``--micro-batch-size`` or ``--max-tokens-per-microbatch``.

    Args:
        whole_groups: Cut only at group boundaries.
        uniform: Give every micro-batch one shape (pipeline stages exchange fixed-size activations).
    """
    lengths = [len(s) for s in batch.sequences]
    parts = micro_batch_rows(
        rows,
        lengths,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens=cfg.max_tokens_per_microbatch,
        group_size=batch.group_size if whole_groups else None,
    )
    num_rows = max(len(p) for p in parts) if uniform else None
    length = max(lengths[i] for p in parts for i in p) if uniform else None
    return [MicroBatch(*pad_rows(batch, p, num_rows=num_rows, length=length)) for p in parts]


def train_on_batch(
    actor: Actor,
    batch: RolloutBatch,
    objective: Objective,
    cfg: BatchConfig,
    groups: ParallelGroups,
    timer: PhaseTimer,
    *,
    temperature: float,
) -> dict[str, float]:
    """All optimizer steps of one training step on this rank's share of ``batch`` (collective).

    Old log-probs are computed only where the parameters may have moved since the rollout (docs/algorithm.md §5);
    then per mini-batch: the phase-1 forward if the objective asks for it, ``prepare``, one optimizer step.

    Returns:
        Metrics reduced over every rank (identical on all ranks): loss and objective metrics, grad norm, skips.
    """
    minis = mini_batch_rows(
        batch.num_prompts, batch.group_size, cfg.ppo_mini_batch_size, groups.dp_rank, groups.dp_size
    )
    micro = partial(micro_batches, batch, cfg=cfg, whole_groups=objective.whole_groups, uniform=groups.pp_size > 1)
    logprobs = partial(actor.logprobs, num_responses=batch.num_responses, temperature=temperature)
    old = None
    if objective.old_logprobs and (len(minis) > 1 or cfg.ppo_epochs > 1):
        rows = [i for m in (minis if cfg.ppo_epochs > 1 else minis[1:]) for i in m]
        with timer.phase("old_logprobs"):
            old = logprobs(micro(rows), tokens=objective.old_logprobs == "token")
    parts: list[dict[str, torch.Tensor]] = []
    results: list[StepResult] = []
    for epoch in range(cfg.ppo_epochs):
        for k, rows in enumerate(minis):
            fresh = epoch == 0 and k == 0  # no optimizer step yet: theta == theta_old
            mbs = micro(rows)
            current = None
            if objective.needs_current(fresh):
                with timer.phase("phase1"):
                    current = logprobs(mbs).seq
            prepared = objective.prepare(
                MiniBatch(
                    rows=torch.tensor(rows),
                    rewards=batch.rewards,
                    response_lens=batch.response_lens,
                    group_size=batch.group_size,
                    fresh=fresh,
                    old=None if fresh else old,
                    current=current,
                )
            )
            with timer.phase("train"):
                result = actor.train(mbs, prepared.loss, temperature=temperature)
            parts.extend(r for r in (prepared.metrics, *result.reports) if r)
            results.append(result)
    return _step_metrics(parts, results, objective.loss_key)


def _step_metrics(parts: list[dict[str, torch.Tensor]], results: list[StepResult], loss_key: str) -> dict[str, float]:
    metrics = _reduce_over_ranks(parts)
    skipped = sum(r.skipped for r in results)
    grad_norms = [r.grad_norm for r in results if not r.skipped]
    metrics["train/optimizer_steps"] = float(len(results) - skipped)
    metrics["train/skipped_steps"] = float(skipped)
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if loss_key in metrics:
        metrics["train/loss"] = metrics[loss_key]
    return metrics


def _reduce_over_ranks(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Exact global metrics from every rank's ``[value, weight]`` entries (TP/PP duplicates scale value and
    weight alike, so means, maxima and minima are unchanged)."""
    local = [{k: v.detach().float().cpu() for k, v in p.items()} for p in parts]
    if not dist.is_initialized():
        return reduce_metrics(local)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return reduce_metrics(p for rank_parts in gathered for p in rank_parts)
