"""Shared pieces of the pure-PyTorch algorithm package: the loss contract, input checks, masked sums.

Shape legend used across ``megatron_pacs.algo``: S = responses in a batch, G = prompt groups, N = group size
(responses per prompt, S = G * N, groups contiguous), T = response tokens (padded).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["LossOutput", "check_choice", "check_finite", "check_groups", "check_rewards", "masked_sequence_sum"]


@dataclass
class LossOutput:
    """A loss as a global sum plus a count, normalised once by the caller.

    ``loss_sum / count`` is the loss of this batch. Summing ``loss_sum`` and ``count`` over micro-batches,
    data-parallel ranks and pipeline micro-batches and dividing once gives the same value (and gradient) as one
    call on the whole batch, whatever the split. For PACS ``count`` is the number of responses.

    Attributes:
        loss_sum: Scalar tensor, carries the graph back to the inputs.
        count: Number of units ``loss_sum`` is normalised by (responses).
        metrics: ``name -> tensor([value, weight])``. Means reduce as ``sum(value) / sum(weight)`` over
            micro-batches and ranks; keys ending in ``/max`` or ``/min`` reduce with max or min of ``value``.
            See :func:`megatron_pacs.algo.metrics.reduce_metrics`.
    """

    loss_sum: torch.Tensor
    count: int
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss(self) -> torch.Tensor:
        """The normalised loss ``loss_sum / count`` of this batch alone (for single-call use)."""
        return self.loss_sum / max(self.count, 1)


def check_choice(name: str, value: str, valid: Iterable[str]) -> None:
    """Raise a ``ValueError`` naming ``name`` and listing the valid options when ``value`` is not one of them."""
    valid = sorted(valid)
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not a valid option; choose one of {valid}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise a ``ValueError`` if ``tensor`` holds NaN or inf (one device sync)."""
    if not bool(torch.isfinite(tensor).all()):
        bad = (~torch.isfinite(tensor)).nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"{name} contains NaN or inf (first bad positions {bad}); drop or fix those responses before the loss"
        )


def check_groups(num_responses: int, group_size: int, *, need_pairs: bool) -> int:
    """Validate the group layout and return the number of groups.

    Args:
        num_responses: S, the number of responses (groups contiguous).
        group_size: N, responses per prompt.
        need_pairs: True when the option needs N >= 2 (leave-one-out or std over the group).
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (responses sampled per prompt)")
    if need_pairs and group_size < 2:
        raise ValueError(
            f"group_size={group_size} is too small for a group baseline (rloo/grpo need >= 2 responses per "
            "prompt); sample more responses per prompt or use advantage='naive'"
        )
    if num_responses % group_size != 0:
        raise ValueError(
            f"the batch has {num_responses} responses, not a multiple of group_size={group_size}; each prompt's "
            "responses must be contiguous and complete"
        )
    return num_responses // group_size


def check_rewards(rewards: torch.Tensor) -> None:
    """Rewards are BCE labels: finite and within [0, 1]."""
    check_finite("rewards", rewards)
    if rewards.numel() and (bool((rewards < 0).any()) or bool((rewards > 1).any())):
        lo, hi = rewards.min().item(), rewards.max().item()
        raise ValueError(
            f"rewards must lie in [0, 1] to serve as BCE labels, got values in [{lo}, {hi}]; "
            "rescale the reward (e.g. (r - r_min) / (r_max - r_min)) or binarise it"
        )


def check_1d(name: str, tensor: torch.Tensor, size: int | None = None) -> None:
    """Raise a ``ValueError`` unless ``tensor`` is 1-D (of length ``size`` when given)."""
    if tensor.dim() != 1 or (size is not None and tensor.shape[0] != size):
        want = f"[{size}]" if size is not None else "[S]"
        raise ValueError(f"{name} must have shape {want} (one value per response), got {tuple(tensor.shape)}")


def masked_sequence_sum(token_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum token log-probs over each response's real tokens.

    Padding never contributes, whatever value it holds (the reference sums unmasked; docs/algorithm.md §9.2).

    Args:
        token_logp: ``[S, T]`` per-token log-probs.
        mask: ``[S, T]`` bool or 0/1 mask of response tokens.

    Returns:
        ``[S]`` per-response sums, accumulated in float64 (a PACS score is a difference of two such sums:
        docs/algorithm.md §2.1).
    """
    if token_logp.shape != mask.shape:
        raise ValueError(f"token_logp {tuple(token_logp.shape)} and mask {tuple(mask.shape)} must have one shape")
    # where() rather than a product so that -inf/NaN at padded positions cannot leak into the sum.
    return torch.where(mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(dim=-1, dtype=torch.float64)


def stat_entries(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean / max / min entries of ``values`` in the metric convention of :class:`LossOutput`."""
    v = values.detach().float()
    n = float(v.numel())
    if v.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": torch.stack([v.sum(), v.new_tensor(n)]),
        f"{prefix}/max": torch.stack([v.max(), v.new_tensor(1.0)]),
        f"{prefix}/min": torch.stack([v.min(), v.new_tensor(1.0)]),
    }


def mean_entry(total: torch.Tensor | float, weight: float, like: torch.Tensor) -> torch.Tensor:
    """One mean entry ``[total, weight]`` as a float32 tensor on ``like``'s device."""
    total = total.detach().float() if isinstance(total, torch.Tensor) else like.new_tensor(float(total)).float()
    return torch.stack([total.to(like.device), torch.tensor(float(weight), device=like.device)])


def as_float_vector(name: str, values: Sequence[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Coerce ``values`` to a float tensor on ``like``'s device."""
    t = torch.as_tensor(values, device=like.device)
    if not torch.is_floating_point(t):
        t = t.float()
    check_1d(name, t, like.shape[0])
    return t
