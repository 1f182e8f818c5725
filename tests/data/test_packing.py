"""Sequence packing: groups dealt to data-parallel ranks by tokens, LPT bins with a capacity, the same number of
micro-batches on every rank, and the packed row layout (``pack_rows``)."""

import random

import pytest
import torch

from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import pack_rows
from megatron_pacs.data.packing import balanced_group_shares, lpt_bins, pack_micro_batches


def _lengths(n: int, seed: int) -> list[int]:
    """A realistic RL mix, scaled down: a short prompt plus a log-normal response with a long tail."""
    rng = random.Random(seed)
    return [20 + min(int(rng.lognormvariate(4.0, 0.8)), 400) for _ in range(n)]


# --- balanced_group_shares ------------------------------------------------------------------------------------------


def test_group_shares_are_equal_in_count_and_balanced_in_tokens():
    tokens = [100, 90, 10, 10, 50, 50, 40, 60]
    shares = balanced_group_shares(tokens, 2)
    assert sorted(g for s in shares for g in s) == list(range(8))
    assert [len(s) for s in shares] == [4, 4]
    loads = [sum(tokens[g] for g in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(tokens)
    assert balanced_group_shares(tokens, 2) == shares  # a pure function of the lengths


@pytest.mark.parametrize("seed", range(5))
def test_group_shares_beat_contiguous_ones_on_a_skewed_batch(seed):
    tokens = sorted(_lengths(32, seed), reverse=True)  # contiguous blocks would give rank 0 all the long groups
    shares = balanced_group_shares(tokens, 4)
    loads = [sum(tokens[g] for g in s) for s in shares]
    contiguous = [sum(tokens[r * 8 : (r + 1) * 8]) for r in range(4)]
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert max(loads) - min(loads) <= max(tokens)


def test_group_shares_need_a_divisible_count():
    with pytest.raises(ValueError, match="5 groups cannot be split evenly over 2"):
        balanced_group_shares([1] * 5, 2)


# --- lpt_bins ---------------------------------------------------------------------------------------------------------


def test_lpt_fills_the_least_loaded_bin_and_respects_the_capacity():
    bins = lpt_bins([5, 4, 3, 3, 2, 1], capacity=9, num_bins=2)
    assert bins is not None
    sizes = [5, 4, 3, 3, 2, 1]
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert sorted(i for b in bins for i in b) == list(range(6)) and max(loads) <= 9 and sorted(loads) == [9, 9]
    assert lpt_bins([5, 5, 5], capacity=9, num_bins=2) is None  # three 5s cannot share two bins of 9
    assert lpt_bins([], capacity=3, num_bins=2) == [[], []]


# --- pack_micro_batches ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("unit", [1, 4])
def test_every_rank_gets_the_same_number_of_micro_batches_each_within_the_budget(seed, unit):
    lengths = _lengths(64, seed)
    ranks = [list(range(r * 16, (r + 1) * 16)) for r in range(4)]
    rank_units = [[rows[k : k + unit] for k in range(0, len(rows), unit)] for rows in ranks]
    capacity = 4 * max(sum(lengths[i] for i in u) for units in rank_units for u in units)
    packed = pack_micro_batches(rank_units, lengths, capacity)
    assert len({len(bins) for bins in packed}) == 1
    for rows, bins in zip(ranks, packed, strict=True):
        assert sorted(i for b in bins for i in b) == rows  # every response exactly once, on its own rank
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        assert all(b == sorted(b) for b in bins)
        if unit > 1:  # whole units stay together
            assert all(len(b) % unit == 0 and all(b[k] % unit == 0 for k in range(0, len(b), unit)) for b in bins)
    # never more micro-batches than needed by much: at least the token lower bound of the fullest rank
    most = max(sum(lengths[i] for i in rows) for rows in ranks)
    assert len(packed[0]) >= -(-most // capacity)


def test_packing_balances_micro_batches_and_pads_short_ranks_with_empty_ones():
    lengths = [50, 50, 50, 50, 10, 10, 10, 10]
    rank_units = [[[0], [1], [2], [3]], [[4]]]
    packed = pack_micro_batches(rank_units, lengths, capacity=100)
    assert [len(b) for b in packed] == [2, 2]
    assert sorted(sum(lengths[i] for i in b) for b in packed[0]) == [100, 100]
    assert [] in packed[1]  # rank 1 has one sequence but must run as many micro-batches as rank 0


def test_a_unit_longer_than_the_budget_names_the_flag():
    with pytest.raises(ValueError, match="exceeds the micro-batch budget of 10 tokens; raise --max-tokens-per-micro"):
        pack_micro_batches([[[0, 1]]], [6, 6], capacity=10)


# --- pack_rows ------------------------------------------------------------------------------------------------------


def test_pack_rows_lays_sequences_end_to_end_with_response_masks_and_a_padded_tail():
    batch = RolloutBatch.from_sequences(
        sequences=[[11, 12, 13], [21, 22, 23, 24], [31, 32]],
        prompt_lens=torch.tensor([1, 2, 1]),
        response_lens=torch.tensor([2, 2, 1]),
        rewards=torch.zeros(3),
        group_size=1,
    )
    tokens, mask, index, seqlens = pack_rows(batch, [2, 0], length=8, pad_id=0)
    assert tokens.tolist() == [[31, 32, 11, 12, 13, 0, 0, 0]]
    assert mask.tolist() == [[False, True, False, True, True, False, False, False]]
    assert index.tolist() == [2, 0] and seqlens == (2, 3)
    tokens, mask, index, seqlens = pack_rows(batch, [])
    assert tokens.shape == (1, 1) and not mask.any() and index.numel() == 0 and seqlens == ()
    with pytest.raises(ValueError, match="do not fit a packed row of 4"):
        pack_rows(batch, [0, 1], length=4)


def test_the_micro_batch_count_can_be_forced_to_a_multiple():
    packed = pack_micro_batches([[[0], [1], [2]]], [10, 10, 10], capacity=100, multiple=4)
    assert len(packed[0]) == 4 and sorted(i for b in packed[0] for i in b) == [0, 1, 2]
