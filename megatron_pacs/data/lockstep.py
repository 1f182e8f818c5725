"""Lockstep over the data-parallel ranks, for expert parallelism (docs/algorithm.md §4.5).

An MoE layer at EP > 1 exchanges tokens with the other ranks of its expert-parallel group, which spans
data-parallel ranks: every forward (and backward) of one rank must meet one of each other rank, in the same order.
So with EP > 1 every pass of the step runs the same number of micro-batches on every data-parallel rank (a rank
short of some runs *filler* micro-batches: padding only, nothing scored, so they add nothing to a loss, a count or
a metric), and with the all-gather dispatcher, which gathers the ranks' hidden states in equal shapes, micro-batch
k has one shape ``[b_k, L_k]`` on every rank. Every rank holds the whole step's lengths and computes every rank's
micro-batches, so they agree without communication.

Pure Python; the data-parallel group is the whole group of ranks that may exchange tokens (with expert tensor
parallelism 1, an EP group is a set of data-parallel ranks, or of the TP ranks of one, which run the same
micro-batches anyway).
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_pacs.algo.tokens import MicroBatch

__all__ = ["Lockstep", "filler", "lockstep_mode"]

#: ``count``: the same number of micro-batches per pass on every data-parallel rank (all-to-all dispatch);
#: ``shape``: also the same ``[b, L]`` for micro-batch k (all-gather dispatch).
Lockstep = Literal["count", "shape"]


def lockstep_mode(ep_size: int, dispatcher: str) -> Lockstep | None:
    """What the data-parallel ranks must agree on (None: nothing, EP=1 or a dense model).

    Args:
        ep_size: ``--expert-model-parallel-size``.
        dispatcher: ``--moe-token-dispatcher-type`` (``allgather`` or ``alltoall``).
    """
    if ep_size <= 1:
        return None
    return "shape" if dispatcher == "allgather" else "count"


def filler(num_rows: int, length: int) -> MicroBatch:
    """A padded micro-batch of padding rows only (token id 0, index -1, nothing scored): it runs the model, and so
    its MoE layers' token exchange, and adds nothing else. (Packed passes need none: packing already gives every
    rank the same number of micro-batches, some of them empty rows, :mod:`megatron_pacs.data.packing`.)

    Returns:
        ``MicroBatch`` with ``tokens [num_rows, length]`` zeros and an empty score mask.
    """
    tokens = torch.zeros(num_rows, length, dtype=torch.long)
    mask = torch.zeros(num_rows, length, dtype=torch.bool)
    return MicroBatch(tokens, mask, torch.full((num_rows,), -1, dtype=torch.long))
