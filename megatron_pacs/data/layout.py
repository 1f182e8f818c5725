"""The step's layout: which data-parallel rank trains which responses, and in which micro-batches.

One function decides the shares (:func:`step_shares`): the rollout distribution (each data-parallel rank receives
the responses of :func:`rank_rows`) and the update (:class:`StepLayout`) both read them from it, so what a rank
receives is exactly what it trains. Pure PyTorch; the layout needs no process group, only four facts of this
rank's place (data-parallel rank and size, pipeline size, whether the schedule is interleaved).

Legend: S responses of the step, n group size.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_pacs.algo.tokens import MicroBatch
from megatron_pacs.config import BatchConfig
from megatron_pacs.data.batching import RolloutBatch, micro_batch_rows, mini_batch_shares, pack_rows, pad_rows
from megatron_pacs.data.lockstep import Lockstep, filler
from megatron_pacs.data.packing import pack_micro_batches

__all__ = ["StepLayout", "rank_rows", "step_shares"]


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
        return self.batch.with_routing(mbs)  # router replay: each token's engine routing, when given

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
