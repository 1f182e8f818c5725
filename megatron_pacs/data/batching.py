"""From rollouts to the trainer's batches: whole groups per data-parallel rank, mini-batches, micro-batches.

Pure PyTorch. Legend: P prompts, n group size, S = P * n responses (groups contiguous), L padded length.

The sizes follow the reference (docs/algorithm.md §4.3): the step's prompts are cut contiguously into mini-batches of
``ppo_mini_batch_size`` prompts, each split over DP ranks in whole groups; a rank's share of a mini-batch is cut
into micro-batches either by a token budget (groups may split: the two-phase gradient makes that exact) or in
whole groups (the reference's constraint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "micro_batch_rows", "mini_batch_rows", "pack_rows", "pad_rows"]


@dataclass
class RolloutBatch:
    """One step's responses in group order (identical on every rank).

    Attributes:
        sequences: S token lists, prompt followed by response.
        prompt_lens: ``[S]`` prompt lengths.
        response_lens: ``[S]`` response lengths (>= 1).
        rewards: ``[S]`` float rewards in [0, 1].
        group_size: n.
        engine_logprobs: ``[sum R_i]`` float32, the engines' log-probs of the sampled response tokens (temperature
            1, response after response; NaN where the engine gave none), or None.
    """

    sequences: list[list[int]]
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    engine_logprobs: torch.Tensor | None = None

    @property
    def num_responses(self) -> int:
        return len(self.sequences)

    @property
    def num_prompts(self) -> int:
        return len(self.sequences) // self.group_size


def mini_batch_rows(
    num_prompts: int, group_size: int, mini_batch_prompts: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """This DP rank's response rows for each mini-batch.

    Mini-batch m holds prompts ``[m * M, (m + 1) * M)``; DP rank r takes the r-th contiguous block of ``M / DP``
    of them (whole groups).

    Returns:
        One list of response indices per mini-batch.
    """
    if num_prompts % mini_batch_prompts or mini_batch_prompts % dp_size:
        raise ValueError(
            f"{num_prompts} prompts cannot form mini-batches of {mini_batch_prompts} prompts split "
            f"over {dp_size} data-parallel ranks"
        )
    per_rank = mini_batch_prompts // dp_size
    rows = []
    for start in range(0, num_prompts, mini_batch_prompts):
        first = start + dp_rank * per_rank
        rows.append(list(range(first * group_size, (first + per_rank) * group_size)))
    return rows


def micro_batch_rows(
    rows: Sequence[int],
    lengths: Sequence[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
    group_size: int | None = None,
) -> list[list[int]]:
    """Cut ``rows`` (in order) into micro-batches.

    Args:
        rows: Response indices, groups contiguous.
        lengths: Sequence length of every response index (indexable by the entries of ``rows``).
        micro_batch_size: Rows per micro-batch when no token budget is given.
        max_tokens: Token budget: a micro-batch's ``rows x longest row`` stays within it (padding counted).
        group_size: Keep whole groups: cut only at group boundaries (``micro_batch_size`` must be a multiple).

    Returns:
        Lists of response indices.
    """
    unit = group_size or 1
    units = [list(rows[i : i + unit]) for i in range(0, len(rows), unit)]
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for u in units:
        u_long = max(lengths[i] for i in u)
        if current:
            new_long = max(longest, u_long)
            too_big = (
                (len(current) + len(u)) * new_long > max_tokens
                if max_tokens is not None
                else len(current) + len(u) > micro_batch_size
            )
            if too_big:
                out.append(current)
                current, longest = [], 0
        current += u
        longest = max(longest, u_long)
    if current:
        out.append(current)
    return out


def pad_rows(
    batch: RolloutBatch, rows: Sequence[int], *, num_rows: int | None = None, length: int | None = None, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tensors of some responses.

    Args:
        batch: The step's rollouts.
        rows: Response indices.
        num_rows: Pad to this many rows (extra rows copy row 0 and get index -1 and an empty mask).
        length: Pad to this length (default: the longest row).

    Returns:
        ``tokens [b, L]`` long, ``score_mask [b, L]`` bool (True at response tokens: those whose log-prob counts),
        ``index [b]`` long (the response index, -1 for padding rows).
    """
    num_rows = num_rows or len(rows)
    length = length or max(len(batch.sequences[i]) for i in rows)
    tokens = torch.full((num_rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros((num_rows, length), dtype=torch.bool)
    index = torch.full((num_rows,), -1, dtype=torch.long)
    for j in range(num_rows):
        i = rows[j] if j < len(rows) else rows[0]
        seq = batch.sequences[i]
        tokens[j, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        if j < len(rows):
            p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
            mask[j, p : p + r] = True
            index[j] = i
    return tokens, mask, index


def pack_rows(
    batch: RolloutBatch, rows: Sequence[int], *, length: int | None = None, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """One packed row of some responses: their sequences one after another, then padding.

    Args:
        batch: The step's rollouts.
        rows: Response indices, in the order to pack them (may be empty: a row of padding only).
        length: The row's length T (default: the sequences' total, at least 1).
        pad_id: Token id of the padding.

    Returns:
        ``tokens [1, T]`` long, ``score_mask [1, T]`` bool (True at response tokens), ``index [m]`` long (the
        response indices), the m sequence lengths.
    """
    lengths = tuple(len(batch.sequences[i]) for i in rows)
    used = sum(lengths)
    total = max(length or used, 1)
    if used > total:
        raise ValueError(f"{used} tokens do not fit a packed row of {total}")
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    mask = torch.zeros((1, total), dtype=torch.bool)
    offset = 0
    for i, n in zip(rows, lengths, strict=True):
        tokens[0, offset : offset + n] = torch.tensor(batch.sequences[i], dtype=torch.long)
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        mask[0, offset + p : offset + p + r] = True
        offset += n
    return tokens, mask, torch.tensor(list(rows), dtype=torch.long), lengths
