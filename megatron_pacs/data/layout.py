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
    pipeline parallelism every packed row of a pass is padded to that pass's fullest row (at most the budget).

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
    ) -> None:
        self.batch, self.cfg, self.whole_groups, self.align = batch, cfg, whole_groups, align
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
        mbs = self._packed(minis) if self.cfg.sequence_packing else self._padded(self.rows(minis))
        return self.batch.with_routing(mbs)  # router replay: each token's engine routing, when given

    def _padded(self, rows: list[int]) -> list[MicroBatch]:
        cfg, batch, lengths = self.cfg, self.batch, self.lengths
        parts = micro_batch_rows(
            rows,
            lengths,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_microbatch,
            group_size=batch.group_size if self.whole_groups else None,
        )
        num_rows = max(len(p) for p in parts) if self.pipeline else None
        longest = max(lengths[i] for p in parts for i in p) if self.pipeline else None
        out = []
        for p in parts:
            length = longest
            if self.align > 1:
                length = _round_up(length or max(lengths[i] for i in p), self.align)
            out.append(MicroBatch(*pad_rows(batch, p, num_rows=num_rows, length=length)))
        return out

    def _packed(self, minis: Sequence[int]) -> list[MicroBatch]:
        unit = self.batch.group_size if self.whole_groups else 1
        rank_units = []
        for r in range(self.dp_size):
            rows = self.rows(minis, r)
            rank_units.append([rows[k : k + unit] for k in range(0, len(rows), unit)])
        budget = _round_up(self.cfg.packing_budget, self.align)
        bins = pack_micro_batches(rank_units, self.lengths, budget, multiple=self.multiple)[self.dp_rank]
        used = [sum(self.lengths[i] for i in b) for b in bins]
        # pipeline messages have one shape per schedule: every row padded to the fullest one (<= the budget)
        longest = _round_up(max([*used, 1]), self.align)
        out = []
        for b, filled in zip(bins, used, strict=True):
            length = longest if self.pipeline else _round_up(max(filled, 1), self.align)
            tokens, mask, index, seqlens = pack_rows(self.batch, b, length=length)
            out.append(MicroBatch(tokens, mask, index, seqlens=seqlens))
        return out
