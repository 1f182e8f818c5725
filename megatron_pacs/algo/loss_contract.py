"""The loss contract every objective keeps: a global sum plus a count, normalised once, and metric entries.

Megatron's ``forward_backward_func`` sums ``(loss_sum, count, report)`` over micro-batches, data-parallel ranks and
the pipeline schedule and divides once, so a loss written to this contract gives the same value and gradient
whatever the split (docs/algorithm.md §4). Metric entries are ``[value, weight]`` tensors that reduce exactly over
the same splits (:func:`megatron_pacs.algo.metrics.reduce_metrics`).

Shape legend used across ``megatron_pacs.algo``: S = responses in a batch, G = prompt groups, N = group size
(responses per prompt, S = G * N, groups contiguous), T = response tokens (padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LossOutput", "mean_entry", "stat_entries"]


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
