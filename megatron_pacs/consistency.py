"""Train/rollout consistency: do the engines and the trainer give the same tokens the same log-probs?

Two views (docs/algorithm.md §7.1):

- **the rollouts' tokens**, during the update: the first mini-batch's training forward runs at the rollout weights
  exactly, so :func:`with_consistency` wraps its loss to report ``consistency/*`` (engine vs trainer log-probs);
- **the sync probe**, right after a weight sync: :func:`probe_sync` scores a few of the step's sequences on both
  sides (``sync/max_logprob_diff``), which also covers steps whose rollouts came from older weights.

:func:`check_logprob_bound` stops the run on every rank alike when either exceeds ``--max-logprob-diff``.

Legend: N scored tokens of a micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.objectives import MicroBatchLoss
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import TrainConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import probe_micro_batch
from megatron_pacs.mcore.actor import Actor

__all__ = ["check_logprob_bound", "probe_due", "probe_sync", "with_consistency"]


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


def with_consistency(loss: MicroBatchLoss, batch: RolloutBatch, bf16: TokenStore | None = None) -> MicroBatchLoss:
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


def probe_due(cfg: TrainConfig, step: int) -> bool:
    """Whether the sync probe runs after step ``step``'s weight sync: after every sync with ``--max-logprob-diff``
    (the consistency check of the update sees only steps whose rollouts came from the current weights, not those
    generated one step off or before a resume), else after the first and at every validation."""
    every = cfg.eval.eval_interval
    return cfg.rollout.max_logprob_diff is not None or step == 1 or bool(every and step % every == 0)


def probe_sync(actor: Actor, fleet: Any, batch: RolloutBatch, *, num_probes: int = 2) -> float:
    """Max |engine - trainer| token log-prob on a few of this step's sequences, right after a weight sync, through
    the engines' prompt log-probs (collective over the world; the same value on every rank).

    Only data-parallel rank 0's model-parallel group computes (its share's first sequences); every pipeline stage
    of it receives the trainer's log-probs, so the driver compares under PP too. Under expert parallelism every
    rank runs the forward (its MoE layers exchange tokens with other data-parallel ranks), each on its own share's
    first sequences in one shape, ``[num_probes, longest of the step]``; only rank 0's are compared.

    Args:
        actor: This rank's actor.
        fleet: The engines (the driver's; None on the other ranks).
        batch: This rank's share of the step's rollouts.
        num_probes: Sequences to probe.
    """
    worst = 0.0
    lockstep = actor.groups.ep_size > 1
    if actor.groups.dp_rank == 0 or lockstep:
        rows, probe = probe_micro_batch(batch, num_probes, lockstep=lockstep)
        logp = actor.probe_logprobs(probe.tokens)
        if fleet is not None:
            probes = [batch.sequence(i).tolist() for i in rows]
            refs = [logp[j, : len(probes[j]) - 1].tolist() for j in range(len(rows))]
            worst = float(fleet.verify_sync(probes, refs))
    if dist.is_initialized() and dist.get_world_size() > 1:  # the driver's value, on every rank
        out = [worst]
        dist.broadcast_object_list(out, src=0)
        worst = float(out[0])
    return worst


def check_logprob_bound(bound: float | None, metrics: dict[str, float], step: int) -> None:
    """``--max-logprob-diff``: stop (on every rank alike: the metrics are global) when the engines' and the
    trainer's log-probs of the same tokens disagree by more than ``bound``: the rollouts' tokens
    (``consistency/logprob_abs_diff_max``) or the probe right after a weight sync (``sync/max_logprob_diff``).

    Raises:
        RuntimeError: Naming the step, the worst difference and the flag.
    """
    if bound is None:
        return
    for key, what in (
        ("consistency/logprob_abs_diff_max", "the rollouts' tokens"),
        ("sync/max_logprob_diff", "the sync probe's tokens, right after the weight sync"),
    ):
        worst = metrics.get(key)
        if worst is not None and worst > bound:
            raise RuntimeError(
                f"step {step}: the engines' and the trainer's token log-probs ({what}) differ by up to "
                f"{worst:.3g} > --max-logprob-diff {bound:g}: weights not synced, a different tokenizer or "
                "dtype (docs/algorithm.md §7.1 lists the expected values)"
            )
