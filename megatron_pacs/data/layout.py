"""The step's layout: which data-parallel rank trains which responses, and in which micro-batches.

One function decides the shares (:func:`step_shares`): the rollout distribution (each data-parallel rank receives
the responses of :func:`rank_rows`) and the update (:class:`StepLayout`) both read them from it, so what a rank
receives is exactly what it trains. The sizes follow the reference (docs/algorithm.md §4.3): the step's prompts are
cut contiguously into mini-batches of ``ppo_mini_batch_size`` prompts, each split over DP ranks in whole groups; a
rank's share of a mini-batch is cut into micro-batches either by a token budget (groups may split: the two-phase
gradient makes that exact) or in whole groups (the reference's constraint). The row primitives at the end
(:func:`mini_batch_rows`, :func:`micro_batch_rows`, :func:`pad_rows`, :func:`pack_rows`) build them.

Pure PyTorch; the layout needs no process group, only four facts of this rank's place (data-parallel rank and size,
pipeline size, whether the schedule is interleaved).

Legend: S responses of the step, n group size, L padded length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_pacs.algo.tokens import MicroBatch
from megatron_pacs.config import BatchConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.lockstep import Lockstep, filler
from megatron_pacs.data.packing import pack_micro_batches

__all__ = [
    "StepLayout",
    "micro_batch_rows",
    "mini_batch_rows",
    "mini_batch_shares",
    "pack_rows",
    "pad_rows",
    "probe_micro_batch",
    "rank_rows",
    "step_shares",
    "with_routing",
]


def step_shares(lengths: Sequence[int], group_size: int, cfg: BatchConfig, dp_size: int) -> list[list[list[int]]]:
    """Every data-parallel rank's responses of every mini-batch of the step (docs/algorithm.md §4.3).

    Padded (``--no-sequence-packing``): contiguous whole groups per rank. Packed: each mini-batch's groups dealt
    to ranks by token count.

    Args:
        lengths: ``[S]`` sequence lengths (prompt + response).
        group_size: n.
        cfg: Batch settings (``--ppo-mini-batch-size`` and the packing choice decide the shares).
        dp_size: Data-parallel ranks.

    Returns:
        ``shares[m][r]``: the response indices rank r trains in mini-batch m, in increasing order.
    """
    return mini_batch_shares(lengths, group_size, cfg.ppo_mini_batch_size, dp_size, balanced=cfg.sequence_packing)


def rank_rows(lengths: Sequence[int], cfg: BatchConfig, group_size: int, dp_size: int) -> list[list[int]]:
    """Each data-parallel rank's responses over every mini-batch of the step, in increasing order."""
    shares = step_shares(lengths, group_size, cfg, dp_size)
    return [sorted(i for mini in shares for i in mini[r]) for r in range(dp_size)]


def probe_micro_batch(batch: RolloutBatch, num_probes: int, *, lockstep: bool) -> tuple[list[int], MicroBatch]:
    """The sync probe's micro-batch: the first ``num_probes`` responses this rank holds, right-padded.

    Args:
        batch: This rank's share of the step's rollouts.
        num_probes: Sequences to probe.
        lockstep: Every rank runs the probe's forward (expert parallelism): the micro-batch then has one shape on
            every rank, ``[num_probes, longest sequence of the step]``.

    Returns:
        The probed response indices, and their micro-batch (``tokens [b, L]``).
    """
    rows = batch.held.nonzero().flatten()[:num_probes].tolist()
    num_rows, length = (num_probes, int(batch.lengths.max())) if lockstep else (None, None)
    return rows, MicroBatch(*pad_rows(batch, rows, num_rows=num_rows, length=length))


def with_routing(batch: RolloutBatch, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """``micro_batches`` (of ``batch``, padded or packed) carrying their tokens' routing
    (:attr:`MicroBatch.routed_experts`, -1 at padding), when the batch has one; unchanged otherwise."""
    if batch.routed_experts is None:
        return micro_batches
    _, layers, k = batch.routed_experts.shape
    for mb in micro_batches:
        b, length = mb.tokens.shape
        routed = torch.full((b, length, layers, k), -1, dtype=batch.routed_experts.dtype)
        starts = [0] * b if mb.seqlens is None else torch.tensor([0, *mb.seqlens]).cumsum(0).tolist()
        for j, i in enumerate(mb.index.tolist()):
            if i < 0:
                continue
            row, start = (j, 0) if mb.seqlens is None else (0, starts[j])
            seq = batch.routed_experts[int(batch.offsets[i]) : int(batch.offsets[i + 1])]
            routed[row, start : start + len(seq)] = seq
        mb.routed_experts = routed
    return micro_batches


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class StepLayout:
    """Who trains which responses: every data-parallel rank's share of each mini-batch, and this rank's
    micro-batches (docs/algorithm.md §4.3-4.4).

    Padded (``--no-sequence-packing``): contiguous whole groups per rank; micro-batches cut in order by row count or
    by a padded token budget, one shape under pipeline parallelism. Packed: groups dealt to ranks by token count,
    then bin-packed into the same number of micro-batches on every rank (:mod:`megatron_pacs.data.packing`); under
    pipeline parallelism every packed row of a pass is padded to that pass's fullest row (at most the budget). Under
    expert parallelism every rank's passes run in lockstep (``lockstep``, :mod:`megatron_pacs.data.lockstep`).

    Args:
        batch: The step's rollouts (identical on every rank).
        cfg: Batch settings.
        dp_rank: This rank's data-parallel rank.
        dp_size: Data-parallel ranks.
        pp_size: Pipeline stages (above 1, every micro-batch of a pass has one shape).
        interleaved: Megatron's interleaved (virtual pipeline) schedule, which runs micro-batches in groups of
            ``pp_size``: their number must be a multiple of it.
        whole_groups: Micro-batches hold whole groups only.
        align: Token-dimension multiple of every micro-batch (sequence parallelism, FP8).
        lockstep: What every data-parallel rank's passes share under expert parallelism
            (:mod:`megatron_pacs.data.lockstep`): ``count`` (the number of micro-batches: short ranks get filler
            micro-batches) or ``shape`` (also micro-batch k's ``[b, L]``); None (EP=1): nothing.
    """

    def __init__(
        self,
        batch: RolloutBatch,
        cfg: BatchConfig,
        *,
        dp_rank: int,
        dp_size: int,
        pp_size: int,
        interleaved: bool,
        whole_groups: bool,
        align: int = 1,
        lockstep: Lockstep | None = None,
    ) -> None:
        self.batch, self.cfg, self.whole_groups, self.align, self.lockstep = batch, cfg, whole_groups, align, lockstep
        self.dp_rank, self.dp_size, self.pipeline = dp_rank, dp_size, pp_size > 1
        self.multiple = pp_size if interleaved else 1
        self.lengths = batch.lengths.tolist()
        self.shares = step_shares(self.lengths, batch.group_size, cfg, dp_size)

    @property
    def num_mini_batches(self) -> int:
        return len(self.shares)

    def rows(self, minis: Sequence[int], rank: int | None = None) -> list[int]:
        """A rank's (default: this rank's) response indices of mini-batches ``minis``, in order."""
        r = self.dp_rank if rank is None else rank
        return [i for m in minis for i in self.shares[m][r]]

    def micro_batches(self, minis: Sequence[int]) -> list[MicroBatch]:
        """This rank's micro-batches over mini-batches ``minis`` (one pass of the model)."""
        mbs = self._packed(minis) if self.cfg.sequence_packing else self._padded(minis)
        return with_routing(self.batch, mbs)  # router replay: each token's engine routing, when given

    def _padded(self, minis: Sequence[int]) -> list[MicroBatch]:
        cfg, batch, lengths = self.cfg, self.batch, self.lengths
        # in lockstep, every rank's cut: the pass runs as many micro-batches as the rank with most (fillers pad)
        ranks = range(self.dp_size) if self.lockstep else [self.dp_rank]
        every = [
            micro_batch_rows(
                self.rows(minis, r),
                lengths,
                micro_batch_size=cfg.micro_batch_size,
                max_tokens=cfg.max_tokens_per_microbatch,
                group_size=batch.group_size if self.whole_groups else None,
            )
            for r in ranks
        ]
        parts = every[self.dp_rank if self.lockstep else 0]
        shaping = every if self.lockstep == "shape" else [parts]  # whose micro-batches set the shapes
        num_rows = max(len(p) for ps in shaping for p in ps) if self.pipeline else None
        longest = max(lengths[i] for ps in shaping for p in ps for i in p) if self.pipeline else None
        out = []
        for k in range(max(len(ps) for ps in every)):
            p = parts[k] if k < len(parts) else []
            rows, length = num_rows, longest
            if self.lockstep == "shape" and not self.pipeline:  # micro-batch k: one [b, L] on every rank
                same_k = [ps[k] for ps in every if k < len(ps)]
                rows, length = max(map(len, same_k)), max(lengths[i] for q in same_k for i in q)
            if self.align > 1 or not p:
                length = _round_up(length or max((lengths[i] for i in p), default=2), self.align)
            if p:
                out.append(MicroBatch(*pad_rows(batch, p, num_rows=rows, length=length)))
            else:
                out.append(filler(rows or 1, length or 2))  # a filler: 2 tokens, one scorable position
        return out

    def _packed(self, minis: Sequence[int]) -> list[MicroBatch]:
        unit = self.batch.group_size if self.whole_groups else 1
        rank_units = []
        for r in range(self.dp_size):
            rows = self.rows(minis, r)
            rank_units.append([rows[k : k + unit] for k in range(0, len(rows), unit)])
        budget = _round_up(self.cfg.packing_budget, self.align)
        every = pack_micro_batches(rank_units, self.lengths, budget, multiple=self.multiple)  # K bins on each rank
        bins = every[self.dp_rank]

        def needs(rank_bins: list[list[int]]) -> list[int]:
            return [_round_up(max(sum(self.lengths[i] for i in b), 1), self.align) for b in rank_bins]

        need = needs(bins)
        if self.lockstep == "shape":  # micro-batch k: one length on every rank
            need = [max(col) for col in zip(*map(needs, every), strict=True)]
        # pipeline messages have one shape per schedule: every row padded to the fullest one (<= the budget)
        longest = max(need)
        out = []
        for b, length in zip(bins, need, strict=True):
            tokens, mask, index, seqlens = pack_rows(self.batch, b, length=longest if self.pipeline else length)
            out.append(MicroBatch(tokens, mask, index, seqlens=seqlens))
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
