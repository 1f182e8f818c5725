"""One RL step's pieces between the fleet and the actor: rollouts -> batch, and the update over mini-batches.

``collect_rollouts`` runs on the driver (rank 0): generate, score, pack. ``train_on_batch`` runs on every rank:
old log-probs where needed, then per mini-batch one optimizer step with the PACS two-phase gradient (or the
direct group-intact loss, or GRPO).

Old log-probs are skipped when provably equal to the current policy (spec Part A item 5): the first mini-batch of
the first epoch is trained before any optimizer step, so ``theta == theta_old`` there; with one mini-batch and one
epoch the whole pass is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_pacs.algo.grpo import grpo_advantages
from megatron_pacs.algo.metrics import pacs_metrics, reduce_metrics
from megatron_pacs.algo.pacs import compute_scores, group_advantages, group_weights, pacs_score_grads
from megatron_pacs.config import TrainConfig
from megatron_pacs.data.batching import RolloutBatch, micro_batch_rows, mini_batch_rows, pad_rows
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.mcore.actor import Actor, LossSpec
from megatron_pacs.mcore.forward import MicroBatch
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.utils.metrics import PhaseTimer

__all__ = ["StepRollouts", "collect_rollouts", "train_on_batch"]


@dataclass
class StepRollouts:
    """What the driver broadcasts: the batch, the texts for the dump, and rollout metrics."""

    batch: RolloutBatch
    records: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def collect_rollouts(fleet: Any, scorer: Any, tokenizer: Any, rows: Sequence[PromptRow], cfg: TrainConfig,
                     step: int, timer: PhaseTimer) -> StepRollouts:  # fmt: skip
    """Driver only: sample ``group_size`` responses per prompt, score them, and pack the batch."""
    from megatron_pacs.rollout.types import SamplingConfig

    r, b = cfg.rollout, cfg.batch
    prompts = [apply_chat_template(tokenizer, row.prompt) for row in rows]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingConfig(n=b.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=b.max_response_length, seed=cfg.run.seed * 1_000_003 + step * 7919,
                              stop_token_ids=eos, logprobs=False)  # fmt: skip
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
            records.append({"step": step, "id": row.id, "data_source": row.data_source, "input": row.question,
                            "output": resp.text, "ground_truth": row.ground_truth})  # fmt: skip
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
    }
    return StepRollouts(batch, records, metrics)


def _to_micro_batches(batch: RolloutBatch, parts: list[list[int]], uniform: bool) -> list[MicroBatch]:
    """Padded micro-batches; ``uniform`` (pipeline parallel) gives all of them one shape."""
    rows = max(len(p) for p in parts) if uniform else None
    length = max(len(batch.sequences[i]) for p in parts for i in p) if uniform else None
    return [MicroBatch(*pad_rows(batch, p, num_rows=rows, length=length)) for p in parts]


def _phase1_metrics(scores: torch.Tensor, rewards: torch.Tensor, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The PACS loss and critic metrics at the phase-1 scores (the loss value the two-phase step minimises)."""
    lc, n = cfg.loss, cfg.batch.group_size
    adv = group_advantages(scores, group_size=n, advantage=lc.pacs_advantage)
    w = group_weights(rewards, group_size=n, weights=lc.pacs_weights)
    loss_sum = F.binary_cross_entropy_with_logits(adv, rewards, weight=w, reduction="sum")
    m = pacs_metrics(scores, adv, rewards, w, group_size=n)
    m["pacs/loss"] = torch.stack([loss_sum, loss_sum.new_tensor(float(scores.numel()))])
    return m


def train_on_batch(actor: Actor, batch: RolloutBatch, cfg: TrainConfig, groups: ParallelGroups, timer: PhaseTimer,
                   *, inject_nan: bool = False) -> dict[str, float]:  # fmt: skip
    """All optimizer steps of one training step on this rank's share of ``batch`` (collective).

    Returns:
        Metrics reduced over every rank (identical on all ranks): loss and critic metrics, grad norm, skips.
    """
    bc, lc = cfg.batch, cfg.loss
    n, num = batch.group_size, batch.num_responses
    pacs = lc.loss == "pacs"
    log_ratio = pacs and lc.pacs_score == "log_ratio"
    two_phase = pacs and not bc.keep_groups_in_microbatch
    lengths = [len(s) for s in batch.sequences]
    minis = mini_batch_rows(batch.num_prompts, n, bc.ppo_mini_batch_size, groups.dp_rank, groups.dp_size)
    uniform = groups.pp_size > 1

    def micro(rows: list[int]) -> list[MicroBatch]:
        parts = micro_batch_rows(rows, lengths, micro_batch_size=bc.micro_batch_size,
                                 max_tokens=bc.max_tokens_per_microbatch,
                                 group_size=n if bc.keep_groups_in_microbatch else None)  # fmt: skip
        return _to_micro_batches(batch, parts, uniform)

    temperature = cfg.rollout.temperature
    old_seq, old_tok = None, None
    need_old = (len(minis) > 1 or bc.ppo_epochs > 1) and (log_ratio or lc.loss == "grpo")
    if need_old:
        rows = [i for m in (minis if bc.ppo_epochs > 1 else minis[1:]) for i in m]
        with timer.phase("old_logprobs"):
            old_seq, old_tok = actor.logprobs(micro(rows), num, temperature=temperature, tokens=lc.loss == "grpo")
    advantages = grpo_advantages(batch.rewards, group_size=n) if lc.loss == "grpo" else None

    parts: list[dict[str, torch.Tensor]] = []
    grad_norms, skipped = [], 0
    for epoch in range(bc.ppo_epochs):
        for k, rows in enumerate(minis):
            fresh = epoch == 0 and k == 0  # no optimizer step yet: theta == theta_old
            mbs = micro(rows)
            spec = LossSpec(kind="grpo" if not pacs else ("pacs_two_phase" if two_phase else "pacs_direct"),
                            rewards=batch.rewards, response_lens=batch.response_lens, group_size=n,
                            beta=lc.pacs_beta, score=lc.pacs_score, advantage=lc.pacs_advantage,
                            weights=lc.pacs_weights, temperature=temperature, advantages=advantages,
                            max_response_len=bc.max_response_length, clip_ratio=lc.clip_ratio)  # fmt: skip
            if log_ratio or lc.loss == "grpo":
                spec.old_seq_logp = None if fresh else old_seq
                spec.old_token_logp = None if fresh else old_tok
            if two_phase:
                idx = torch.tensor(rows)
                with timer.phase("phase1"):
                    if fresh and log_ratio:
                        scores = torch.zeros(len(rows))
                    else:
                        cur, _ = actor.logprobs(mbs, num, temperature=temperature)
                        old = old_seq[idx].cpu() if log_ratio else None
                        scores = compute_scores(cur[idx].cpu(), old, beta=lc.pacs_beta, score=lc.pacs_score,
                                                response_lens=batch.response_lens[idx])  # fmt: skip
                coeffs = torch.zeros(num)
                coeffs[idx] = pacs_score_grads(scores, batch.rewards[idx], group_size=n, advantage=lc.pacs_advantage,
                                               weights=lc.pacs_weights, normalizer=1.0)  # fmt: skip
                spec.coeffs = coeffs
                if spec.old_seq_logp is None and log_ratio:
                    spec.old_seq_logp = torch.zeros(num)  # only the gradient of the surrogate matters here
                parts.append(_phase1_metrics(scores, batch.rewards[idx], cfg))
            with timer.phase("train"):
                result = actor.train(mbs, spec, inject_nan=inject_nan)
            parts.extend(r for r in result.reports if r)
            skipped += result.skipped
            if not result.skipped:
                grad_norms.append(result.grad_norm)
    metrics = _reduce_over_ranks(parts)
    metrics["train/optimizer_steps"] = float(len(minis) * bc.ppo_epochs - skipped)
    metrics["train/skipped_steps"] = float(skipped)
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    loss_key = "pacs/loss" if pacs else "grpo/loss"
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
