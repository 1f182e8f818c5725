"""Padding-free sequence packing: which responses share a packed micro-batch, on every data-parallel rank.

Pure Python, deterministic: every rank holds the whole step's batch, so every rank computes every rank's plan and
all agree without communication (docs/algorithm.md §4.4).

1. **Groups to ranks.** A mini-batch's groups are dealt to the data-parallel ranks in equal numbers, longest
   (most tokens) first onto the least loaded rank that still has room, so ranks carry similar token counts.
2. **Sequences to micro-batches.** Each rank's units (responses, or whole groups with
   ``--keep-groups-in-microbatch``) are bin-packed into micro-batches of at most ``capacity`` tokens, longest first
   onto the least filled micro-batch it fits in (LPT with a capacity), which balances the micro-batches' token
   counts rather than filling them one after another. Every rank gets the same number of micro-batches: the
   smallest count with which every rank's units fit, starting from ``ceil(tokens / capacity)`` of the fullest
   rank; a rank with fewer units than micro-batches gets empty ones.

Legend: P prompts of a mini-batch, n group size, K micro-batches per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["balanced_group_shares", "lpt_bins", "pack_micro_batches"]


def balanced_group_shares(group_tokens: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Deal groups to ranks: equal counts, balanced token totals.

    Args:
        group_tokens: ``[P]`` tokens of each group (prompt + response over its n responses).
        num_ranks: Data-parallel ranks; must divide P.

    Returns:
        For each rank, its groups' positions in ``group_tokens``, in increasing order.
    """
    if len(group_tokens) % num_ranks:
        raise ValueError(f"{len(group_tokens)} groups cannot be split evenly over {num_ranks} data-parallel ranks")
    per_rank = len(group_tokens) // num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    # Ties broken by position, so the deal is a pure function of the lengths.
    for g in sorted(range(len(group_tokens)), key=lambda i: (-group_tokens[i], i)):
        r = min((r for r in range(num_ranks) if len(shares[r]) < per_rank), key=lambda r: (loads[r], r))
        shares[r].append(g)
        loads[r] += group_tokens[g]
    return [sorted(s) for s in shares]


def lpt_bins(sizes: Sequence[int], capacity: int, num_bins: int) -> list[list[int]] | None:
    """Longest first onto the least filled bin it fits in.

    Args:
        sizes: Item sizes (tokens).
        capacity: Bin capacity (tokens).
        num_bins: Bins to fill (some may stay empty).

    Returns:
        Item positions per bin (each in increasing order), or None when some item fits in no bin.
    """
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        fits = [b for b in range(num_bins) if loads[b] + sizes[i] <= capacity]
        if not fits:
            return None
        b = min(fits, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += sizes[i]
    return [sorted(b) for b in bins]


def pack_micro_batches(
    rank_units: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int], capacity: int, *, multiple: int = 1
) -> list[list[list[int]]]:
    """Pack every rank's units into the same number of micro-batches of at most ``capacity`` tokens.

    Args:
        rank_units: For each rank, its units, each a list of response indices kept together (one response, or a
            whole group).
        lengths: Sequence length (prompt + response) of every response index.
        capacity: Token budget of a micro-batch.
        multiple: The number of micro-batches is a multiple of this (PP under interleaved pipelining, whose
            schedule runs micro-batches in groups of PP).

    Returns:
        For each rank, K micro-batches, each a list of response indices in increasing order (possibly empty).

    Raises:
        ValueError: a unit is longer than ``capacity``.
    """
    sizes = [[sum(lengths[i] for i in unit) for unit in units] for units in rank_units]
    longest = max((s for rank in sizes for s in rank), default=0)
    if longest > capacity:
        raise ValueError(
            f"a packing unit of {longest} tokens exceeds the micro-batch budget of {capacity} tokens; raise "
            "--max-tokens-per-microbatch (with --keep-groups-in-microbatch it must hold a whole group)"
        )
    most_units = max((len(rank) for rank in sizes), default=0)
    num_bins = max(1, max((math.ceil(sum(rank) / capacity) for rank in sizes), default=1))
    num_bins = math.ceil(num_bins / multiple) * multiple
    while True:
        # LPT fills K bins whenever each unit fits alone, so this ends by K = most_units at the latest.
        packed = [lpt_bins(rank, capacity, num_bins) for rank in sizes]
        if all(p is not None for p in packed):
            break
        num_bins += multiple
        assert num_bins <= max(most_units, 1) + multiple, "one unit per bin always fits"
    out = []
    for units, bins in zip(rank_units, packed, strict=True):
        assert bins is not None
        out.append([sorted(i for u in b for i in units[u]) for b in bins])
    return out
