"""Importance weights of off-policy rollouts from their raw ratios: truncated or masked (``--tis-mode``).

A raw ratio is ``pi_anchor / pi_behaviour`` of one token (GRPO) or one response (PACS), the anchor being the policy
at the start of the step and the behaviour the engines' (docs/algorithm.md §5.1). ``truncate`` clips the ratio into
``[low, high]`` (truncated importance sampling; with ``low = 0`` that is ``min(ratio, high)``); ``mask`` keeps the
ratio where it lies in ``[low, high]`` and gives 0 elsewhere (masked importance sampling): the token or response
then adds nothing to the loss, but still counts in its normaliser (the loss contract's count and GRPO's constant
token normaliser are unchanged), as in verl's mask mode.

Legend: K ratios (tokens or responses).
"""

from __future__ import annotations

import torch

__all__ = ["TIS_MODES", "bound_ratios"]

TIS_MODES = ("truncate", "mask")
"""The ``--tis-mode`` values."""


def bound_ratios(
    ratios: torch.Tensor, *, mode: str, high: float, low: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weights of ``ratios`` under ``mode``, and which ratios left ``[low, high]``.

    Args:
        ratios: ``[K]`` raw importance ratios (non-negative; any float dtype).
        mode: ``truncate`` (clip into ``[low, high]``) or ``mask`` (0 outside ``[low, high]``, the ratio inside).
        high: Upper bound (> 1: an on-policy ratio of 1 is kept as it is).
        low: Lower bound, in ``[0, 1)``; 0 bounds nothing from below.

    Returns:
        ``[K]`` weights (``ratios``' dtype), and ``[K]`` bool: the ratios truncated or masked. A NaN ratio is masked
        (weight 0) but not truncated (it stays NaN, for the step's non-finite check).
    """
    if mode not in TIS_MODES:
        raise ValueError(f"--tis-mode {mode!r} is not one of {list(TIS_MODES)}")
    if not 0.0 <= low < 1.0 < high:
        raise ValueError(f"--tis-low {low} and --tis-high {high} must satisfy 0 <= low < 1 < high")
    if mode == "mask":
        inside = (ratios >= low) & (ratios <= high)
        return torch.where(inside, ratios, torch.zeros_like(ratios)), ~inside
    # low = 0 leaves the lower side alone (a ratio is never negative): min(ratio, high), bit for bit
    weights = ratios.clamp(min=low, max=high) if low > 0 else ratios.clamp(max=high)
    return weights, (ratios > high) | (ratios < low)
