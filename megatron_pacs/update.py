"""The update of one RL step, on every rank: the log-probs the objective needs, then per mini-batch ``prepare``
and one optimizer step.

:func:`update_policy` reads as the algorithm; what to compute is the objective's to say
(:mod:`megatron_pacs.algo.objectives`), who trains which responses the layout's (:mod:`megatron_pacs.data.layout`),
and this module only schedules it. Vocabulary: a *training step* is one iteration of the loop (rollouts, update,
weight sync); the *update* is every optimizer step of a training step; an *optimizer step* is one mini-batch's
forward, backward and parameter update (:meth:`~megatron_pacs.mcore.actor.Actor.optimizer_step`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.importance import bound_ratios
from megatron_pacs.algo.metrics import reduce_metrics
from megatron_pacs.algo.objectives import Logprobs, MiniBatch, Objective
from megatron_pacs.algo.pacs import warn_degenerate_std
from megatron_pacs.algo.tokens import TokenStore
from megatron_pacs.config import BatchConfig
from megatron_pacs.consistency import with_consistency
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import StepLayout
from megatron_pacs.data.lockstep import lockstep_mode
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.optim import StepResult
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.utils.timing import PhaseTimer

__all__ = ["reduce_over_ranks", "step_layout", "truncated_importance", "update_policy"]


def step_layout(
    batch: RolloutBatch, cfg: BatchConfig, groups: ParallelGroups, *, whole_groups: bool, align: int = 1
) -> StepLayout:
    """The step's :class:`~megatron_pacs.data.layout.StepLayout` for this rank's place in ``groups``."""
    return StepLayout(
        batch,
        cfg,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        pp_size=groups.pp_size,
        interleaved=bool(groups.config.virtual_pipeline_model_parallel_size),
        whole_groups=whole_groups,
        align=align,
        lockstep=lockstep_mode(groups.ep_size, groups.config.moe_token_dispatcher_type),
    )


def update_policy(
    actor: Actor,
    batch: RolloutBatch,
    objective: Objective,
    cfg: BatchConfig,
    groups: ParallelGroups,
    timer: PhaseTimer,
    *,
    temperature: float,
    reference: ReferencePolicy | None = None,
    tis_mode: str = "truncate",
    tis_low: float = 0.0,
    tis_high: float = 2.0,
    same_weights: bool = True,
    score_fp8: bool = False,
    advantages: TokenStore | None = None,
) -> dict[str, float]:
    """All optimizer steps of one training step on this rank's share of ``batch`` (collective).

    The reference's log-probs (when the objective needs them) come once, over every response, in the same
    micro-batches. Old log-probs are computed only where the parameters may have moved since the rollout
    (docs/algorithm.md §5); then per mini-batch: the phase-1 forward if the objective asks for it, ``prepare``,
    one optimizer step. The first mini-batch's training forward runs at the rollout weights exactly, so it also
    measures train/rollout consistency against the engines' log-probs (§7.1).

    Args:
        tis_mode: ``--tis-mode``: truncate or mask the importance ratios to ``[tis_low, tis_high]``
            (:func:`~megatron_pacs.algo.importance.bound_ratios`).
        tis_low: ``--tis-low``.
        tis_high: ``--tis-high``.
        same_weights: The rollouts were generated with the weights the step starts from (not one step off), so
            the consistency check compares like with like; every rank must pass the same value.
        score_fp8: With an FP8 model, run the forward-only passes whose log-probs enter scores and ratios (old,
            phase 1, reference) in FP8 too (``--fp8-score-precision fp8``); else they run in bf16.
        advantages: Per-token advantages from a learned critic (``--loss ppo``:
            :func:`megatron_pacs.critic_update.update_critic`), handed to the objective.

    Returns:
        Metrics reduced over every rank (identical on all ranks): loss and objective metrics, grad norm, skips,
        padding fraction, training throughput, consistency.
    """
    started = time.perf_counter()
    layout = step_layout(batch, cfg, groups, whole_groups=objective.whole_groups, align=actor.token_alignment)
    logprobs = partial(actor.logprobs, response_lens=batch.response_lens, temperature=temperature, fp8=score_fp8)
    minis = list(range(layout.num_mini_batches))
    ref, old, importance = None, None, None
    correct = objective.correction is not None and batch.engine_logprobs is not None
    need_old = correct or bool(objective.old_logprobs and (len(minis) > 1 or cfg.ppo_epochs > 1))
    old_tokens = "token" in {objective.old_logprobs, objective.correction}
    if objective.ref_logprobs:
        if reference is None:
            raise ValueError("this objective needs the reference policy's log-probs; pass the ReferencePolicy")
        # one schedule, two models: the actor's old log-probs (when needed) ride along on every mini-batch
        with timer.phase("ref_logprobs"):
            ref, old = reference.logprobs(
                layout.micro_batches(minis),
                batch.response_lens,
                temperature=temperature,
                tokens=objective.ref_logprobs == "token",
                fp8=score_fp8,
                actor=actor if need_old else None,
                actor_tokens=old_tokens,
            )
    elif need_old:
        with timer.phase("old_logprobs"):
            # the off-policy correction needs the start-of-step policy on every response, the first mini-batch's too
            which = minis if cfg.ppo_epochs > 1 or correct else minis[1:]
            old = logprobs(layout.micro_batches(which), tokens=old_tokens)
    parts: list[dict[str, torch.Tensor]] = []
    if correct:
        assert old is not None and objective.correction is not None
        importance, report = truncated_importance(
            old, batch, objective.correction, mode=tis_mode, low=tis_low, high=tis_high
        )
        # token ratios exist on the last pipeline stage only (elsewhere the store is all zeros: 1 / p_engine)
        if objective.correction != "token" or groups.is_last_stage:
            parts.append(report)
    results: list[StepResult] = []
    padding = processed = 0
    # the parameters are the reference's exactly until this step's first update (step 1, or right after a reset)
    equal_to_reference = reference is not None and reference.equals_actor
    for epoch in range(cfg.ppo_epochs):
        for k in minis:
            fresh = epoch == 0 and k == 0  # no optimizer step yet: theta == theta_old
            at_reference = fresh and equal_to_reference
            mbs = layout.micro_batches([k])
            current = None
            if objective.needs_current(fresh, at_reference):
                with timer.phase("phase1"):
                    current = logprobs(mbs).seq
            prepared = objective.prepare(
                MiniBatch(
                    rows=torch.tensor(layout.rows([k])),
                    rewards=batch.rewards,
                    response_lens=batch.response_lens,
                    group_size=batch.group_size,
                    fresh=fresh,
                    old=None if fresh else old,
                    current=current,
                    ref=ref,
                    importance=importance,
                    at_reference=at_reference,
                    batch_rows=torch.tensor([i for r in range(layout.dp_size) for i in layout.rows([k], r)]),
                    advantages=advantages,
                )
            )
            check = fresh and same_weights and batch.engine_logprobs is not None
            loss = prepared.loss
            if check:
                bf16 = None
                if actor.fp8:  # a bf16 pass at temperature 1 separates FP8's gap from a sync error
                    with timer.phase("consistency"):
                        bf16 = actor.logprobs(mbs, batch.response_lens, temperature=1.0, tokens=True, fp8=False).tokens
                loss = with_consistency(prepared.loss, batch, bf16)
                if batch.routed_experts is not None:  # router replay: the trainer's own routing vs the engine's
                    with timer.phase("consistency"):
                        assert batch.engine_logprobs is not None
                        engine = TokenStore(batch.engine_logprobs, batch.engine_offsets)
                        parts.append(actor.routing_report(mbs, engine))
            with timer.phase("train"):
                result = actor.optimizer_step(
                    mbs, loss, temperature=temperature, raw_logprobs=check, entropy_grad=objective.entropy_grad
                )
            parts.extend(r for r in (prepared.metrics, *result.reports) if r)
            results.append(result)
            if reference is not None and not result.skipped:
                reference.equals_actor = False
            padding += sum(mb.num_padding for mb in mbs)
            processed += sum(mb.tokens.numel() for mb in mbs)
    parts.append({"train/padding_fraction": torch.tensor([float(padding), float(processed)])})
    metrics = _step_metrics(parts, results, objective.loss_keys)
    warn_degenerate_std(metrics)
    real_tokens = sum(layout.lengths) * cfg.ppo_epochs
    metrics["train/tokens_per_second"] = real_tokens / (time.perf_counter() - started)
    return metrics


def truncated_importance(
    anchor: Logprobs, batch: RolloutBatch, level: str, *, high: float, low: float = 0.0, mode: str = "truncate"
) -> tuple[Logprobs, dict[str, torch.Tensor]]:
    """The importance weights of this rank's responses: ``pi_anchor / pi_behaviour`` truncated into ``[low, high]``
    (``min(ratio, high)`` with ``low = 0``) or, with ``mode="mask"``, 0 outside it (docs/algorithm.md §5.1).

    The behaviour policy is the engines' (their log-probs of the sampled tokens); the anchor is the policy at the
    start of the step. Sequence level (a PACS score and loss are per response): the ratio of the responses'
    likelihoods; geometric (PACS's default): its per-token geometric mean ``exp((l_anchor - l_engine) / R_i)``,
    whose bias from engine/trainer numerics does not grow with the length; token level (GRPO): per token. What the
    engines gave no log-prob for counts as on-policy (ratio 1): the token at token level, the whole response at
    the response levels.

    Returns:
        ``Logprobs`` holding the weights (``seq`` ``[S]`` or ``tokens``; 1 where this rank holds no response), and
        the metrics ``offpolicy/is_ratio_mean`` (before truncation) and the share of ratios outside the bounds:
        ``offpolicy/is_truncated`` or, masking, ``offpolicy/is_masked`` (of the tokens at token level, of the
        responses at the response levels).
    """
    assert batch.engine_logprobs is not None
    held = batch.held.nonzero().flatten().tolist()
    engine = batch.engine_logprobs.double()
    if level in ("sequence", "geometric"):
        device = anchor.seq.device
        per_response = (batch.engine_offsets[1:] - batch.engine_offsets[:-1]).to(device)
        engine = engine.to(device)
        behaviour = torch.segment_reduce(torch.nan_to_num(engine, nan=0.0), "sum", lengths=per_response, unsafe=True)
        missing = torch.segment_reduce(engine.isnan().double(), "sum", lengths=per_response, unsafe=True) > 0
        log_ratio = anchor.seq.double() - behaviour
        if level == "geometric":
            log_ratio = log_ratio / per_response.clamp(min=1).double()
        raw = torch.where(missing, 1.0, torch.exp(log_ratio))[held]
        ratios = torch.ones(batch.num_responses, dtype=torch.float64, device=device)
        weights, outside = bound_ratios(raw, mode=mode, low=low, high=high)
        ratios[held] = weights
        out = Logprobs(ratios)
    else:
        assert anchor.tokens is not None, "token-level ratios need the anchor's token log-probs"
        store = anchor.tokens
        device = store.values.device
        # the held responses' token positions in the anchor's store, in the engines' (held-only) order
        spans = [torch.arange(int(store.offsets[i]), int(store.offsets[i + 1])) for i in held]
        pos = torch.cat(spans).to(device) if spans else torch.zeros(0, dtype=torch.long, device=device)
        engine = engine.to(device)
        raw = torch.where(torch.isfinite(engine), torch.exp(store.values[pos].double() - engine), 1.0)
        values = torch.ones_like(store.values)
        weights, outside = bound_ratios(raw, mode=mode, low=low, high=high)
        values[pos] = weights.to(values.dtype)
        out = Logprobs(torch.ones(batch.num_responses, dtype=torch.float64), TokenStore(values, store.offsets))
    n = torch.tensor(float(raw.numel()))
    bounded = "offpolicy/is_masked" if mode == "mask" else "offpolicy/is_truncated"
    report = {
        "offpolicy/is_ratio_mean": torch.stack([raw.sum().float().cpu(), n]),
        bounded: torch.stack([outside.sum().float().cpu(), n]),
    }
    return out, report


def _step_metrics(
    parts: list[dict[str, torch.Tensor]], results: list[StepResult], loss_keys: tuple[str, ...]
) -> dict[str, float]:
    metrics = reduce_over_ranks(parts)
    skipped = sum(r.skipped for r in results)
    grad_norms = [r.grad_norm for r in results if not r.skipped]
    metrics["train/optimizer_steps"] = float(len(results) - skipped)
    metrics["train/skipped_steps"] = float(skipped)
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if loss_keys[0] in metrics:
        metrics["train/loss"] = sum(metrics.get(k, 0.0) for k in loss_keys)
    return metrics


def reduce_over_ranks(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Exact global metrics from every rank's ``[value, weight]`` entries (TP/PP duplicates scale value and
    weight alike, so means, maxima and minima are unchanged)."""
    local = [{k: v.detach().float().cpu() for k, v in p.items()} for p in parts]
    if not dist.is_initialized():
        return reduce_metrics(local)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return reduce_metrics(p for rank_parts in gathered for p in rank_parts)
