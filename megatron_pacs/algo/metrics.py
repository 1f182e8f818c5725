"""Loss metrics in a reducible form, and the PACS metrics the reference does not log (docs/algorithm.md §7).

Convention: every metric is a float tensor ``[value, weight]``. Means reduce as ``sum(value) / sum(weight)``
over micro-batches and ranks, so they are exact global means whatever the split; keys ending in ``/max`` or
``/min`` (or ``_max`` / ``_min``) reduce by max or min of ``value``. A distributed caller all-reduces the stacked
tensors with SUM, MAX and MIN by the same rule (see :func:`reduction_of`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from megatron_pacs.algo.loss_contract import mean_entry, stat_entries

__all__ = ["pacs_metrics", "reduce_metrics", "reduction_of"]


def reduction_of(key: str) -> str:
    """``"max"``, ``"min"`` or ``"mean"``: how metric ``key`` reduces across micro-batches and ranks."""
    if key.endswith(("/max", "_max")):
        return "max"
    if key.endswith(("/min", "_min")):
        return "min"
    return "mean"


def reduce_metrics(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """Combine metric dicts (one per micro-batch or rank) into final floats.

    Args:
        parts: Dicts of ``name -> tensor([value, weight])``.

    Returns:
        ``name -> float``; a mean whose total weight is 0 is omitted.
    """
    acc: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, val in part.items():
            val = val.detach().float().cpu()
            if key not in acc:
                acc[key] = val.clone()
            elif reduction_of(key) == "max":
                acc[key] = torch.maximum(acc[key], val)
            elif reduction_of(key) == "min":
                acc[key] = torch.minimum(acc[key], val)
            else:
                acc[key] = acc[key] + val
    out: dict[str, float] = {}
    for key, (value, weight) in ((k, v.tolist()) for k, v in acc.items()):
        if reduction_of(key) != "mean":
            out[key] = value
        elif weight > 0:
            out[key] = value / weight
    return out


def pacs_metrics(
    scores: torch.Tensor,
    logits: torch.Tensor,
    rewards: torch.Tensor,
    weights: torch.Tensor,
    *,
    group_size: int,
    sample_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The implicit critic's calibration and the batch's group statistics.

    ``sigmoid(A_i)`` is the policy's own estimate that response i is correct. Reported: its mean over correct and
    over wrong responses, its accuracy as a classifier of R (a logit of exactly 0 counts as half right), the
    share of all-correct and all-wrong groups, and statistics of scores, logits and weights.

    Args:
        scores: ``[S]`` scores s.
        logits: ``[S]`` group-centred logits A.
        rewards: ``[S]`` rewards in [0, 1]; > 0.5 counts as correct.
        weights: ``[S]`` class weights w (``pacs/weight``; under ``balanced`` their mean is 1).
        group_size: N (whole groups, contiguous).
        sample_weights: ``[S]`` truncated importance ratios multiplying w in the loss (``pacs/tis_weight``), or
            None.

    Returns:
        Metric dict in the ``[value, weight]`` convention.
    """
    with torch.no_grad():
        p = torch.sigmoid(logits.detach().float())
        pos = rewards.detach() > 0.5
        neg = ~pos
        predicted = torch.where(logits.detach() == 0, torch.full_like(p, 0.5), (p > 0.5).float())
        correct = torch.where(pos, predicted, 1.0 - predicted)
        k = pos.view(-1, group_size).sum(-1)
        num_groups = k.numel()
        m: dict[str, torch.Tensor] = {
            "pacs/critic_p_correct": mean_entry(p[pos].sum(), int(pos.sum()), p),
            "pacs/critic_p_wrong": mean_entry(p[neg].sum(), int(neg.sum()), p),
            "pacs/critic_acc": mean_entry(correct.sum(), p.numel(), p),
            "pacs/all_correct_groups": mean_entry((k == group_size).sum().float(), num_groups, p),
            "pacs/all_wrong_groups": mean_entry((k == 0).sum().float(), num_groups, p),
            "pacs/reward_mean": mean_entry(rewards.detach().float().sum(), p.numel(), p),
        }
        m.update(stat_entries("pacs/score", scores))
        m.update(stat_entries("pacs/logit", logits))
        m.update(stat_entries("pacs/weight", weights))
        if sample_weights is not None:
            m.update(stat_entries("pacs/tis_weight", sample_weights))
    return m
