"""One RL step between the fleet and the actor: rollouts -> batch, then the update over mini-batches.

``collect_rollouts`` runs on the driver (rank 0): generate, score, pack. ``train_on_batch`` runs on every rank and
reads as the algorithm: the log-probs the objective needs, then per mini-batch ``prepare`` and one optimizer step.
What to compute is the objective's to say (:mod:`megatron_pacs.algo.objectives`); this module only schedules it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.metrics import reduce_metrics
from megatron_pacs.algo.objectives import Logprobs, MicroBatchLoss, MiniBatch, Objective
from megatron_pacs.algo.pacs import warn_degenerate_std
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, TrainConfig
from megatron_pacs.data.batching import RolloutBatch, micro_batch_rows, mini_batch_shares, pack_rows, pad_rows
from megatron_pacs.data.packing import pack_micro_batches
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.forward import MicroBatch
from megatron_pacs.mcore.optim import StepResult
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.utils.metrics import PhaseTimer
from megatron_pacs.utils.seeding import SAMPLING_STREAM, derive_seed

__all__ = ["StepLayout", "StepRollouts", "collect_rollouts", "train_on_batch"]


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
        # an independent stream per (seed, step): ``seed * a + step * b`` let seed s at a late step reuse seed s+1's
        # early per-prompt seeds (``base + i * n + j`` covers a window of the integers)
        seed=derive_seed(cfg.run.seed, SAMPLING_STREAM, step),
        stop_token_ids=eos,
        logprobs=True,  # the sampled tokens' log-probs at temperature 1: the train/rollout consistency check
    )
    with timer.phase("generate"):
        groups = fleet.generate(prompts, sampling)
    with timer.phase("reward"):
        texts = [resp.text for g in groups for resp in g.responses]
        truths = [row.ground_truth for row in rows for _ in range(b.group_size)]
        scored = scorer.score(texts, truths)
    sequences, prompt_lens, response_lens, records, clipped = [], [], [], [], 0
    engine_logprobs: list[float] = []
    for row, prompt, g in zip(rows, prompts, groups, strict=True):
        for resp in g.responses:
            ids = list(resp.token_ids) or eos[:1] or [0]  # an empty response still needs one scored token
            engine_logprobs += resp.logprobs if len(resp.logprobs) == len(ids) else [float("nan")] * len(ids)
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
    batch = RolloutBatch.from_sequences(
        sequences,
        torch.tensor(prompt_lens),
        torch.tensor(response_lens),
        rewards,
        b.group_size,
        engine_logprobs=torch.tensor(engine_logprobs, dtype=torch.float32),
    )
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
        "reward/num_verify_timeouts": float(scored.num_verify_timeouts),
    }
    return StepRollouts(batch, records, metrics)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class StepLayout:
    """Who trains which responses: every data-parallel rank's share of each mini-batch, and this rank's
    micro-batches (docs/algorithm.md §4.3-4.4).

    Padded (``--no-sequence-packing``): contiguous whole groups per rank; micro-batches cut in order by row count or
    by a padded token budget, one shape under pipeline parallelism. Packed: groups dealt to ranks by token count,
    then bin-packed into the same number of micro-batches on every rank (:mod:`megatron_pacs.data.packing`); under
    pipeline parallelism every packed row of a pass is padded to that pass's fullest row (at most the budget).

    Args:
        batch: The step's rollouts (identical on every rank).
        cfg: Batch settings.
        groups: This rank's parallel groups.
        whole_groups: Micro-batches hold whole groups only.
        align: Token-dimension multiple of every micro-batch (sequence parallelism, FP8).
    """

    def __init__(
        self, batch: RolloutBatch, cfg: BatchConfig, groups: ParallelGroups, *, whole_groups: bool, align: int = 1
    ) -> None:
        self.batch, self.cfg, self.whole_groups, self.align = batch, cfg, whole_groups, align
        self.dp_rank, self.dp_size, self.pipeline = groups.dp_rank, groups.dp_size, groups.pp_size > 1
        # Megatron's interleaved schedule runs micro-batches in groups of PP: their number must be a multiple.
        self.multiple = groups.pp_size if groups.config.virtual_pipeline_model_parallel_size else 1
        self.lengths = batch.lengths.tolist()
        self.shares = mini_batch_shares(
            self.lengths, batch.group_size, cfg.ppo_mini_batch_size, groups.dp_size, balanced=cfg.sequence_packing
        )

    @property
    def num_mini_batches(self) -> int:
        return len(self.shares)

    def rows(self, minis: Sequence[int], rank: int | None = None) -> list[int]:
        """A rank's (default: this rank's) response indices of mini-batches ``minis``, in order."""
        r = self.dp_rank if rank is None else rank
        return [i for m in minis for i in self.shares[m][r]]

    def micro_batches(self, minis: Sequence[int]) -> list[MicroBatch]:
        """This rank's micro-batches over mini-batches ``minis`` (one pass of the model)."""
        return self._packed(minis) if self.cfg.sequence_packing else self._padded(self.rows(minis))

    def _padded(self, rows: list[int]) -> list[MicroBatch]:
        cfg, batch, lengths = self.cfg, self.batch, self.lengths
        parts = micro_batch_rows(
            rows,
            lengths,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_microbatch,
            group_size=batch.group_size if self.whole_groups else None,
        )
        num_rows = max(len(p) for p in parts) if self.pipeline else None
        longest = max(lengths[i] for p in parts for i in p) if self.pipeline else None
        out = []
        for p in parts:
            length = longest
            if self.align > 1:
                length = _round_up(length or max(lengths[i] for i in p), self.align)
            out.append(MicroBatch(*pad_rows(batch, p, num_rows=num_rows, length=length)))
        return out

    def _packed(self, minis: Sequence[int]) -> list[MicroBatch]:
        unit = self.batch.group_size if self.whole_groups else 1
        rank_units = []
        for r in range(self.dp_size):
            rows = self.rows(minis, r)
            rank_units.append([rows[k : k + unit] for k in range(0, len(rows), unit)])
        budget = _round_up(self.cfg.packing_budget, self.align)
        bins = pack_micro_batches(rank_units, self.lengths, budget, multiple=self.multiple)[self.dp_rank]
        used = [sum(self.lengths[i] for i in b) for b in bins]
        # pipeline messages have one shape per schedule: every row padded to the fullest one (<= the budget)
        longest = _round_up(max([*used, 1]), self.align)
        out = []
        for b, filled in zip(bins, used, strict=True):
            length = longest if self.pipeline else _round_up(max(filled, 1), self.align)
            tokens, mask, index, seqlens = pack_rows(self.batch, b, length=length)
            out.append(MicroBatch(tokens, mask, index, seqlens=seqlens))
        return out


def train_on_batch(
    actor: Actor,
    batch: RolloutBatch,
    objective: Objective,
    cfg: BatchConfig,
    groups: ParallelGroups,
    timer: PhaseTimer,
    *,
    temperature: float,
    reference: ReferencePolicy | None = None,
    tis_cap: float = 2.0,
    same_weights: bool = True,
    score_fp8: bool = False,
) -> dict[str, float]:
    """All optimizer steps of one training step on this rank's share of ``batch`` (collective).

    The reference's log-probs (when the objective needs them) come once, over every response, in the same
    micro-batches. Old log-probs are computed only where the parameters may have moved since the rollout
    (docs/algorithm.md §5); then per mini-batch: the phase-1 forward if the objective asks for it, ``prepare``,
    one optimizer step. The first mini-batch's training forward runs at the rollout weights exactly, so it also
    measures train/rollout consistency against the engines' log-probs (§7.1).

    Args:
        same_weights: The rollouts were generated with the weights the step starts from (not one step off), so
            the consistency check compares like with like; every rank must pass the same value.
        score_fp8: With an FP8 model, run the forward-only passes whose log-probs enter scores and ratios (old,
            phase 1, reference) in FP8 too (``--fp8-score-precision fp8``); else they run in bf16.

    Returns:
        Metrics reduced over every rank (identical on all ranks): loss and objective metrics, grad norm, skips,
        padding fraction, training throughput, consistency.
    """
    started = time.perf_counter()
    layout = StepLayout(batch, cfg, groups, whole_groups=objective.whole_groups, align=actor.token_alignment)
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
        importance, report = truncated_importance(old, batch, objective.correction, cap=tis_cap)
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
                )
            )
            check = fresh and same_weights and batch.engine_logprobs is not None
            loss = prepared.loss
            if check:
                bf16 = None
                if actor.fp8:  # a bf16 pass at temperature 1 separates FP8's gap from a sync error
                    with timer.phase("consistency"):
                        bf16 = actor.logprobs(mbs, batch.response_lens, temperature=1.0, tokens=True, fp8=False).tokens
                loss = _with_consistency(prepared.loss, batch, bf16)
            with timer.phase("train"):
                result = actor.train(mbs, loss, temperature=temperature, raw_logprobs=check)
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
    anchor: Logprobs, batch: RolloutBatch, level: str, *, cap: float
) -> tuple[Logprobs, dict[str, torch.Tensor]]:
    """``min(pi_anchor / pi_behaviour, cap)`` for this rank's responses (docs/algorithm.md §5.1).

    The behaviour policy is the engines' (their log-probs of the sampled tokens); the anchor is the policy at the
    start of the step. Sequence level (a PACS score and loss are per response): the ratio of the responses'
    likelihoods; geometric (PACS's default): its per-token geometric mean ``exp((l_anchor - l_engine) / R_i)``,
    whose bias from engine/trainer numerics does not grow with the length; token level (GRPO): per token. What the
    engines gave no log-prob for counts as on-policy (ratio 1): the token at token level, the whole response at
    the response levels.

    Returns:
        ``Logprobs`` holding the ratios (``seq`` ``[S]`` or ``tokens``; 1 where this rank holds no response), and
        the metrics ``offpolicy/is_ratio_mean`` (before truncation) and ``offpolicy/is_truncated``.
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
        ratios[held] = raw.clamp(max=cap)
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
        values[pos] = raw.clamp(max=cap).to(values.dtype)
        out = Logprobs(torch.ones(batch.num_responses, dtype=torch.float64), TokenStore(values, store.offsets))
    n = torch.tensor(float(raw.numel()))
    report = {
        "offpolicy/is_ratio_mean": torch.stack([raw.sum().float().cpu(), n]),
        "offpolicy/is_truncated": torch.stack([(raw > cap).sum().float().cpu(), n]),
    }
    return out, report


def _gap(prefix: str, delta: torch.Tensor, seen: torch.Tensor, tokens: TokenLogprobs) -> dict[str, torch.Tensor]:
    """Per-token |delta| mean and max, and the response sums' largest |delta|, over the ``seen`` tokens."""
    delta = torch.where(seen, delta, 0.0)
    n = seen.sum().float()
    seq = tokens.sequence_sums(delta).abs()
    zero = delta.new_zeros(())
    return {
        f"{prefix}logprob_abs_diff_mean": torch.stack([delta.abs().sum(), n]),
        f"{prefix}logprob_abs_diff_max": torch.stack([delta.abs().max() if delta.numel() else zero, n]),
        f"{prefix}seq_logprob_abs_diff_max": torch.stack([seq.max().float() if seq.numel() else zero, n]),
    }


def _with_consistency(loss: MicroBatchLoss, batch: RolloutBatch, bf16: TokenStore | None = None) -> MicroBatchLoss:
    """``loss`` that also reports the engines' vs the trainer's log-probs of the same tokens under the same weights
    (docs/algorithm.md §7.1): per-token |difference| mean and max, the response sums' largest |difference| (what a
    PACS score sees), and the k3 estimate of KL(engine || trainer). With an FP8 trainer, ``bf16`` holds a bf16
    pass's log-probs: ``consistency/*`` then compares the engines with it (a sync error shows there) and
    ``consistency/fp8_gap_*`` the FP8 training pass with it (the precision's own gap)."""
    assert batch.engine_logprobs is not None
    offsets = batch.engine_offsets  # the responses this rank holds
    stores: dict[torch.device, TokenStore] = {}

    def wrapped(tokens: TokenLogprobs):
        loss_sum, count, report = loss(tokens)
        device = tokens.logp.device
        if device not in stores:
            assert batch.engine_logprobs is not None
            stores[device] = TokenStore(batch.engine_logprobs.to(device), offsets.to(device))
        engine = stores[device].gather(tokens)
        trained = (tokens.raw if tokens.raw is not None else tokens.logp.detach()).float()
        trainer = trained if bf16 is None else bf16.gather(tokens).float()
        seen = torch.isfinite(engine)
        delta = torch.where(seen, trainer - engine, 0.0)
        report = {**report, **_gap("consistency/", delta, seen, tokens)}
        # samples come from the engine: k3 of KL(engine || trainer), r = log p_trainer - log p_engine
        k3 = torch.where(seen, torch.expm1(delta) - delta, 0.0).sum()
        report["consistency/k3"] = torch.stack([k3, seen.sum().float()])
        if bf16 is not None:
            report.update(_gap("consistency/fp8_gap_", trained - trainer, torch.ones_like(seen), tokens))
        return loss_sum, count, report

    return wrapped


def _step_metrics(
    parts: list[dict[str, torch.Tensor]], results: list[StepResult], loss_keys: tuple[str, ...]
) -> dict[str, float]:
    metrics = _reduce_over_ranks(parts)
    skipped = sum(r.skipped for r in results)
    grad_norms = [r.grad_norm for r in results if not r.skipped]
    metrics["train/optimizer_steps"] = float(len(results) - skipped)
    metrics["train/skipped_steps"] = float(skipped)
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if loss_keys[0] in metrics:
        metrics["train/loss"] = sum(metrics.get(k, 0.0) for k in loss_keys)
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
