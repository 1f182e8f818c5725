"""The step's layout: who trains which responses, padded (today's contiguous cuts, exactly) or packed (token-balanced
groups per data-parallel rank, the same number of micro-batches everywhere, one row shape under PP)."""

import random

import pytest
import torch

from megatron_pacs.config import BatchConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import StepLayout, micro_batch_rows, mini_batch_rows, rank_rows, step_shares
from megatron_pacs.data.lockstep import Lockstep, lockstep_mode


def _batch(num_prompts: int, group_size: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    prompts = [rng.randint(8, 20) for _ in range(num_prompts)]
    seqs, plens, rlens = [], [], []
    for p in prompts:
        for _ in range(group_size):
            r = min(1 + int(rng.lognormvariate(3.0, 0.9)), 120)
            seqs.append(list(range(3, 3 + p + r)))
            plens.append(p)
            rlens.append(r)
    return RolloutBatch.from_sequences(
        seqs, torch.tensor(plens), torch.tensor(rlens), torch.zeros(len(seqs)), group_size
    )


def _layout(
    batch: RolloutBatch,
    cfg: BatchConfig,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_size: int = 1,
    interleaved: bool = False,
    whole_groups: bool = False,
    align: int = 1,
    lockstep: Lockstep | None = None,
) -> StepLayout:
    """A layout from the four facts of a rank's place (no process group is needed to plan one)."""
    return StepLayout(
        batch,
        cfg,
        dp_rank=dp_rank,
        dp_size=dp_size,
        pp_size=pp_size,
        interleaved=interleaved,
        whole_groups=whole_groups,
        align=align,
        lockstep=lockstep,
    )


def test_padded_layout_is_todays_contiguous_cut():
    batch = _batch(8, 4)
    cfg = BatchConfig(
        global_batch_size=8, group_size=4, ppo_mini_batch_size=4, micro_batch_size=3, sequence_packing=False
    )
    layout = _layout(batch, cfg, dp_rank=1, dp_size=2)
    assert [layout.rows([m]) for m in range(2)] == mini_batch_rows(8, 4, 4, 1, 2)
    lengths = batch.lengths.tolist()
    parts = micro_batch_rows(layout.rows([0]), lengths, micro_batch_size=3)
    mbs = layout.micro_batches([0])
    assert [mb.sequence_index.tolist() for mb in mbs] == parts and not any(mb.packed for mb in mbs)


@pytest.mark.parametrize("pp_size", [1, 2])
@pytest.mark.parametrize("whole_groups", [False, True])
def test_packed_layout_covers_each_response_once_with_equal_micro_batch_counts(pp_size, whole_groups):
    batch = _batch(16, 4, seed=pp_size)
    cfg = BatchConfig(
        global_batch_size=16,
        group_size=4,
        ppo_mini_batch_size=8,
        micro_batch_size=4,
        max_prompt_length=20,
        max_response_length=120,
    )
    budget = cfg.packing_budget
    layouts = [_layout(batch, cfg, dp_rank=r, dp_size=4, pp_size=pp_size, whole_groups=whole_groups) for r in range(4)]
    for m in range(2):
        per_rank = [layout.micro_batches([m]) for layout in layouts]
        assert len({len(mbs) for mbs in per_rank}) == 1
        seen = sorted(int(i) for mbs in per_rank for mb in mbs for i in mb.sequence_index)
        assert seen == list(range(m * 32, (m + 1) * 32))
        for mbs in per_rank:
            fullest = max(mb.tokens.numel() - mb.num_padding for mb in mbs)
            for mb in mbs:
                assert mb.packed and mb.tokens.shape[0] == 1
                assert mb.tokens.shape[1] <= budget
                if pp_size > 1:  # one message shape per schedule: the fullest row's, no more
                    assert mb.tokens.shape[1] == fullest
                if whole_groups:
                    idx = mb.sequence_index.tolist()
                    assert len(idx) % 4 == 0 and all(idx[k] % 4 == 0 for k in range(0, len(idx), 4))
        # whole groups per rank, balanced: each rank's token total is within one group of the mean
        totals = [sum(int(batch.lengths[i]) for i in layouts[r].rows([m])) for r in range(4)]
        group_tokens = [sum(int(batch.lengths[i]) for i in range(g * 4, g * 4 + 4)) for g in range(16)]
        assert max(totals) - min(totals) <= max(group_tokens)


def test_interleaved_pipelining_gets_a_multiple_of_pp_micro_batches():
    batch = _batch(4, 2)
    cfg = BatchConfig(global_batch_size=4, group_size=2, ppo_mini_batch_size=4, max_tokens_per_microbatch=100_000)
    plain = _layout(batch, cfg, pp_size=4).micro_batches([0])
    interleaved = _layout(batch, cfg, pp_size=4, interleaved=True)
    assert len(plain) == 1 and len(interleaved.micro_batches([0])) == 4


def test_alignment_rounds_every_micro_batch_up():
    batch = _batch(4, 2)
    for packing in (True, False):
        cfg = BatchConfig(
            global_batch_size=4, group_size=2, ppo_mini_batch_size=4, micro_batch_size=2, sequence_packing=packing
        )
        mbs = _layout(batch, cfg, align=16).micro_batches([0])
        assert all(mb.tokens.shape[1] % 16 == 0 for mb in mbs)


def test_a_group_larger_than_the_packed_budget_is_refused_at_configuration():
    with pytest.raises(ValueError, match="--max-tokens-per-microbatch: 2000 cannot hold a whole group of 8"):
        BatchConfig(keep_groups_in_microbatch=True, max_tokens_per_microbatch=2000, micro_batch_size=8)


@pytest.mark.parametrize("packing", [True, False])
def test_the_distribution_sends_each_rank_exactly_what_its_layout_trains(packing):
    """One function decides the shares: what ``rank_rows`` sends a data-parallel rank (the rollout distribution) is
    what that rank's layout trains over every mini-batch."""
    batch = _batch(16, 4, seed=3)
    cfg = BatchConfig(
        global_batch_size=16, group_size=4, ppo_mini_batch_size=8, micro_batch_size=4, sequence_packing=packing
    )
    lengths = batch.lengths.tolist()
    sent = rank_rows(lengths, cfg, 4, 4)
    for r in range(4):
        layout = _layout(batch, cfg, dp_rank=r, dp_size=4)
        minis = range(layout.num_mini_batches)
        trained = sorted(int(i) for mb in layout.micro_batches(minis) for i in mb.sequence_index)
        assert trained == sent[r] == sorted(layout.rows(minis))
        assert layout.shares == step_shares(lengths, 4, cfg, 4)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_expert_parallel_lockstep_gives_every_rank_the_same_passes(packing, pp_size):
    """Under EP > 1 (docs/algorithm.md §4.5) every data-parallel rank runs the same number of micro-batches per pass
    (a padded cut by token budget gives the ranks different counts: the short ranks get fillers that score nothing)
    and, for the all-gather dispatcher, micro-batch k has one shape on every rank; what each rank trains is
    unchanged, and without lockstep (EP=1) so is every micro-batch."""
    assert (lockstep_mode(1, "allgather"), lockstep_mode(2, "alltoall"), lockstep_mode(2, "allgather")) == (
        None,
        "count",
        "shape",
    )
    batch = _batch(8, 4, seed=3)
    cfg = BatchConfig(
        global_batch_size=8,
        group_size=4,
        ppo_mini_batch_size=8,
        micro_batch_size=4,
        max_tokens_per_microbatch=240,
        max_prompt_length=20,
        max_response_length=120,
        sequence_packing=packing,
    )
    plain = [_layout(batch, cfg, dp_rank=r, dp_size=4, pp_size=pp_size).micro_batches([0]) for r in range(4)]
    if not packing:
        assert len({len(mbs) for mbs in plain}) > 1, "the case must give the ranks different counts"
    for mode in ("count", "shape"):
        runs = [
            _layout(batch, cfg, dp_rank=r, dp_size=4, pp_size=pp_size, lockstep=mode).micro_batches([0])
            for r in range(4)
        ]
        assert len({len(mbs) for mbs in runs}) == 1
        for mbs, before in zip(runs, plain, strict=True):
            real = [mb for mb in mbs if mb.sequence_index.numel()]
            assert [mb.sequence_index.tolist() for mb in real] == [
                mb.sequence_index.tolist() for mb in before if mb.sequence_index.numel()
            ]
            fillers = mbs[len(real) :]
            assert all(not mb.score_mask.any() and mb.sequence_index.numel() == 0 for mb in fillers)
        if mode == "shape" or pp_size > 1:
            for k in range(len(runs[0])):
                shapes = {tuple(mbs[k].tokens.shape) for mbs in runs} if mode == "shape" else set()
                assert len(shapes) <= 1
        if mode == "count" and pp_size == 1:
            # alltoall takes any shapes: each rank's real micro-batches keep their own
            assert all(
                torch.equal(a.tokens, b.tokens)
                for mbs, before in zip(runs, plain, strict=True)
                for a, b in zip(mbs, before, strict=False)
            )
