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

from megatron_pacs.algo.tokens import MicroBatch

__all__ = ["RolloutBatch", "micro_batch_rows", "mini_batch_rows", "mini_batch_shares", "pack_rows", "pad_rows"]


@dataclass
class RolloutBatch:
    """One step's responses in group order, as flat tensors.

    The metadata (lengths, rewards) covers all S responses on every rank; the tokens may cover only some of them
    (a data-parallel rank's share, :meth:`share`): ``offsets`` then gives the others length 0.

    Attributes:
        token_ids: ``[sum L_i]`` long, the held sequences (prompt + response) one after another, in index order.
        offsets: ``[S + 1]`` long: sequence i is ``token_ids[offsets[i]:offsets[i + 1]]`` (empty when not held).
        prompt_lens: ``[S]`` prompt lengths.
        response_lens: ``[S]`` response lengths (>= 1).
        rewards: ``[S]`` float rewards in [0, 1].
        group_size: n.
        engine_logprobs: ``[sum R_i]`` float32, the engines' log-probs of the held responses' sampled tokens
            (temperature 1, response after response; NaN where the engine gave none), or None.
        routed_experts: ``[sum L_i, layers, k]`` int16, aligned with ``token_ids``: the experts the engine routed
            each held token to, for router replay (``--router-replay r3``); -1 where it gave none (a sequence's
            last token, which the engine never ran through the model); None without replay.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    engine_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        prompt_lens: torch.Tensor,
        response_lens: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        engine_logprobs: torch.Tensor | None = None,
        routed_experts: Sequence[torch.Tensor | None] | None = None,
    ) -> RolloutBatch:
        """A batch holding every sequence, from token lists (prompt followed by response), and with
        ``routed_experts`` the engine's routing of each (``[tokens, layers, k]`` from its first token, vLLM's
        ``L_i - 1``; None for a sequence without one: the batch then has none)."""
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
        offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        flat = [t for s in sequences for t in s]
        return cls(
            torch.tensor(flat, dtype=torch.long),
            offsets,
            prompt_lens,
            response_lens,
            rewards,
            group_size,
            engine_logprobs,
            _aligned_routing(routed_experts, lengths.tolist()),
        )

    @property
    def num_responses(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_prompts(self) -> int:
        return self.num_responses // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        """``[S]`` sequence lengths (prompt + response), known on every rank."""
        return self.prompt_lens.long() + self.response_lens.long()

    @property
    def held(self) -> torch.Tensor:
        """``[S]`` bool: the sequences whose tokens this batch holds."""
        return self.offsets[1:] > self.offsets[:-1]

    @property
    def engine_offsets(self) -> torch.Tensor:
        """``[S + 1]``: response i's engine log-probs are ``engine_logprobs[engine_offsets[i]:engine_offsets[i+1]]``."""
        out = torch.zeros(self.num_responses + 1, dtype=torch.long)
        out[1:] = torch.cumsum(torch.where(self.held, self.response_lens.long(), 0), 0)
        return out

    def sequence(self, i: int) -> torch.Tensor:
        """``[L_i]`` token ids of sequence i (it must be held)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if end == start:
            raise ValueError(f"sequence {i} is not held by this batch (another data-parallel rank's share)")
        return self.token_ids[start:end]

    @property
    def sequences(self) -> list[list[int]]:
        """Token lists of every sequence (empty where not held); for dumps and small tools, not the hot path."""
        return [
            self.token_ids[int(a) : int(b)].tolist() for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)
        ]

    def share(self, rows: Sequence[int]) -> RolloutBatch:
        """The same batch holding only ``rows``' tokens (and engine log-probs)."""
        keep = sorted(set(rows))
        tokens = [self.sequence(i) for i in keep]
        lengths = torch.zeros(self.num_responses, dtype=torch.long)
        lengths[keep] = self.lengths[keep]
        offsets = torch.zeros(self.num_responses + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        engine = None
        if self.engine_logprobs is not None:
            eo = self.engine_offsets
            parts = [self.engine_logprobs[int(eo[i]) : int(eo[i + 1])] for i in keep]
            engine = torch.cat(parts) if parts else self.engine_logprobs[:0]
        flat = torch.cat(tokens) if tokens else self.token_ids[:0]
        routed = None
        if self.routed_experts is not None:
            parts = [self.routed_experts[int(self.offsets[i]) : int(self.offsets[i + 1])] for i in keep]
            routed = torch.cat(parts) if parts else self.routed_experts[:0]
        return RolloutBatch(
            flat, offsets, self.prompt_lens, self.response_lens, self.rewards, self.group_size, engine, routed
        )

    def with_routing(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """``micro_batches`` (of this batch, padded or packed) carrying their tokens' routing
        (:attr:`MicroBatch.routed_experts`, -1 at padding), when the batch has one; unchanged otherwise."""
        if self.routed_experts is None:
            return micro_batches
        _, layers, k = self.routed_experts.shape
        for mb in micro_batches:
            b, length = mb.tokens.shape
            routed = torch.full((b, length, layers, k), -1, dtype=self.routed_experts.dtype)
            starts = [0] * b if mb.seqlens is None else torch.tensor([0, *mb.seqlens]).cumsum(0).tolist()
            for j, i in enumerate(mb.index.tolist()):
                if i < 0:
                    continue
                row, start = (j, 0) if mb.seqlens is None else (0, starts[j])
                seq = self.routed_experts[int(self.offsets[i]) : int(self.offsets[i + 1])]
                routed[row, start : start + len(seq)] = seq
            mb.routed_experts = routed
        return micro_batches


def _aligned_routing(routing: Sequence[torch.Tensor | None] | None, lengths: list[int]) -> torch.Tensor | None:
    """``[sum L_i, layers, k]`` int16 from each sequence's ``[<= L_i, layers, k]`` (-1 beyond what was given)."""
    if not routing or any(r is None for r in routing):
        return None
    given = [r for r in routing if r is not None]
    _, layers, k = given[0].shape
    out = torch.full((sum(lengths), layers, k), -1, dtype=torch.int16)
    offset = 0
    for r, n in zip(given, lengths, strict=True):
        m = min(n, r.shape[0])
        out[offset : offset + m] = r[:m].to(torch.int16)
        offset += n
    return out


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


def mini_batch_shares(
    lengths: Sequence[int], group_size: int, mini_batch_prompts: int, dp_size: int, *, balanced: bool
) -> list[list[list[int]]]:
    """Every data-parallel rank's responses of every mini-batch (whole groups), the same on every rank.

    Args:
        lengths: ``[S]`` sequence lengths (prompt + response).
        group_size: n.
        mini_batch_prompts: Prompts per mini-batch.
        dp_size: Data-parallel ranks.
        balanced: Deal each mini-batch's groups to ranks by token count
            (:func:`~megatron_pacs.data.packing.balanced_group_shares`, used with packing); else contiguous blocks
            (:func:`mini_batch_rows`).

    Returns:
        ``shares[m][r]``: the response indices rank r trains in mini-batch m, in increasing order.
    """
    from megatron_pacs.data.packing import balanced_group_shares

    num_prompts = len(lengths) // group_size
    if not balanced:
        per_rank = [mini_batch_rows(num_prompts, group_size, mini_batch_prompts, r, dp_size) for r in range(dp_size)]
        return [[per_rank[r][m] for r in range(dp_size)] for m in range(len(per_rank[0]))]
    mini_batch_rows(num_prompts, group_size, mini_batch_prompts, 0, dp_size)  # the same divisibility checks
    shares = []
    for start in range(0, num_prompts, mini_batch_prompts):
        first = [(start + g) * group_size for g in range(mini_batch_prompts)]
        tokens = [sum(lengths[f : f + group_size]) for f in first]
        dealt = balanced_group_shares(tokens, dp_size)
        shares.append([[first[g] + j for g in share for j in range(group_size)] for share in dealt])
    return shares


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

    Raises:
        ValueError: ``rows`` are not whole groups, or (counting rows) ``micro_batch_size`` is not a multiple of
            ``group_size``.
    """
    if group_size:
        if len(rows) % group_size:
            raise ValueError(f"{len(rows)} rows are not whole groups of {group_size}: cannot keep groups intact")
        if max_tokens is None and micro_batch_size % group_size:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} is not a multiple of group_size={group_size}: whole groups "
                "would overfill it (set --micro-batch-size to a multiple of --group-size)"
            )
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

    Raises:
        ValueError: ``num_rows`` is fewer than ``len(rows)`` or ``length`` is shorter than a response (either
            would drop tokens whose loss counts).
    """
    if num_rows is not None and num_rows < len(rows):
        raise ValueError(f"pad_rows: num_rows={num_rows} is fewer than the {len(rows)} responses to pad")
    num_rows = num_rows or len(rows)
    longest = max(int(batch.lengths[i]) for i in rows)
    if length is not None and length < longest:
        worst = max(rows, key=lambda i: int(batch.lengths[i]))
        raise ValueError(f"pad_rows: length={length} is shorter than response {worst} ({longest} tokens)")
    length = length or longest
    tokens = torch.full((num_rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros((num_rows, length), dtype=torch.bool)
    index = torch.full((num_rows,), -1, dtype=torch.long)
    for j in range(num_rows):
        i = rows[j] if j < len(rows) else rows[0]
        seq = batch.sequence(i)
        tokens[j, : len(seq)] = seq
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
    lengths = tuple(int(batch.lengths[i]) for i in rows)
    used = sum(lengths)
    total = max(length or used, 1)
    if used > total:
        raise ValueError(f"{used} tokens do not fit a packed row of {total}")
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    mask = torch.zeros((1, total), dtype=torch.bool)
    offset = 0
    for i, n in zip(rows, lengths, strict=True):
        tokens[0, offset : offset + n] = batch.sequence(i)
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        mask[0, offset + p : offset + p + r] = True
        offset += n
    return tokens, mask, torch.tensor(list(rows), dtype=torch.long), lengths
