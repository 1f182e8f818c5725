"""Rollout batching: mini-batch rows per data-parallel rank, micro-batch cuts (row count, token budget, whole
groups), right-padding with the response score mask, and the ``RolloutBatch`` properties."""

import itertools

import pytest
import torch

from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import micro_batch_rows, mini_batch_rows, pad_rows


def make_batch(prompt_lens, response_lens, group_size=1):
    """Response i's tokens are ``100 * (i + 1) + k`` (k the position), so every token names its row and place."""
    pairs = enumerate(zip(prompt_lens, response_lens, strict=True))
    seqs = [[100 * (i + 1) + k for k in range(p + r)] for i, (p, r) in pairs]
    return RolloutBatch.from_sequences(
        sequences=seqs,
        prompt_lens=torch.tensor(prompt_lens),
        response_lens=torch.tensor(response_lens),
        rewards=torch.linspace(0, 1, len(seqs)),
        group_size=group_size,
    )


# --- RolloutBatch ---------------------------------------------------------------------------------------------------


def test_rollout_batch_counts():
    batch = make_batch([2] * 6, [1, 2, 3, 1, 2, 3], group_size=3)
    assert batch.num_responses == 6
    assert batch.num_prompts == 2
    assert make_batch([1] * 8, [1] * 8, group_size=4).num_prompts == 2
    assert make_batch([1] * 5, [1] * 5, group_size=1).num_prompts == 5


# --- mini_batch_rows ------------------------------------------------------------------------------------------------


def test_mini_batch_rows_example():
    # 4 prompts of 2 responses, mini-batches of 2 prompts over 2 ranks: each rank gets one group per mini-batch.
    assert mini_batch_rows(4, 2, 2, dp_rank=0, dp_size=2) == [[0, 1], [4, 5]]
    assert mini_batch_rows(4, 2, 2, dp_rank=1, dp_size=2) == [[2, 3], [6, 7]]
    # One rank, one mini-batch: everything in order.
    assert mini_batch_rows(3, 2, 3, dp_rank=0, dp_size=1) == [[0, 1, 2, 3, 4, 5]]
    # Group size 1: rows are prompts.
    assert mini_batch_rows(4, 1, 2, dp_rank=0, dp_size=1) == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("num_prompts", "group_size", "mini", "dp_size"),
    [(8, 4, 4, 2), (8, 2, 8, 4), (6, 3, 2, 1), (12, 1, 6, 3), (4, 5, 4, 4), (8, 2, 2, 2)],
)
def test_mini_batch_rows_cover_every_response_once(num_prompts, group_size, mini, dp_size):
    per_rank = [mini_batch_rows(num_prompts, group_size, mini, r, dp_size) for r in range(dp_size)]
    num_minis = num_prompts // mini
    assert all(len(m) == num_minis for m in per_rank)
    for m in range(num_minis):
        # Mini-batch m is exactly prompts [m * mini, (m + 1) * mini), rank shares concatenated in rank order.
        joined = [i for r in range(dp_size) for i in per_rank[r][m]]
        assert joined == list(range(m * mini * group_size, (m + 1) * mini * group_size))
        for r in range(dp_size):
            share = per_rank[r][m]
            assert len(share) == mini // dp_size * group_size
            assert share == list(range(share[0], share[0] + len(share)))  # contiguous
            assert share[0] % group_size == 0  # starts at a group boundary: whole groups only
    every = sorted(i for shares in per_rank for m in shares for i in m)
    assert every == list(range(num_prompts * group_size))


@pytest.mark.parametrize(
    ("num_prompts", "mini", "dp_size"),
    [(5, 2, 1), (6, 4, 2), (4, 3, 1), (4, 4, 3), (8, 2, 4)],
)
def test_mini_batch_rows_bad_divisibility(num_prompts, mini, dp_size):
    with pytest.raises(ValueError, match="cannot form mini-batches"):
        mini_batch_rows(num_prompts, 2, mini, 0, dp_size)


# --- micro_batch_rows -----------------------------------------------------------------------------------------------


def check_partition(parts, rows):
    """Order preserved and every row exactly once, no empty micro-batch."""
    assert all(parts)
    assert [i for p in parts for i in p] == list(rows)


def test_micro_batch_rows_by_count():
    rows = list(range(7))
    lengths = [5] * 7
    assert micro_batch_rows(rows, lengths, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert micro_batch_rows(rows, lengths, micro_batch_size=7) == [rows]
    assert micro_batch_rows(rows, lengths, micro_batch_size=1) == [[i] for i in rows]
    assert micro_batch_rows([], [], micro_batch_size=2) == []


def test_micro_batch_rows_by_count_on_a_rank_share():
    # Rows need not start at 0; lengths is indexed by the row ids, not positions.
    lengths = [1] * 4 + [9, 9, 9, 9, 9, 9]
    assert micro_batch_rows([4, 5, 6, 7, 8, 9], lengths, micro_batch_size=4) == [[4, 5, 6, 7], [8, 9]]


def test_micro_batch_rows_token_budget_example():
    lengths = [4, 4, 4, 8, 2, 2, 2, 2, 2]
    # budget 12: [0,1,2] is 3 x 4; adding 3 would be 4 x 8; [3] alone is 8; [3,4] is 2 x 8 = 16 > 12;
    # [4..8] is 5 x 2 = 10.
    parts = micro_batch_rows(range(9), lengths, micro_batch_size=1, max_tokens=12)
    assert parts == [[0, 1, 2], [3], [4, 5, 6, 7, 8]]


def test_micro_batch_rows_token_budget_ignores_micro_batch_size():
    parts = micro_batch_rows(range(6), [1] * 6, micro_batch_size=2, max_tokens=6)
    assert parts == [list(range(6))]


def test_micro_batch_rows_token_budget_counts_padding():
    # Sum of lengths 1 + 1 + 10 = 12 fits a budget of 12, but padded it is 3 x 10 = 30.
    parts = micro_batch_rows(range(3), [1, 1, 10], micro_batch_size=8, max_tokens=12)
    assert parts == [[0, 1], [2]]


def test_micro_batch_rows_over_budget_row_alone():
    lengths = [3, 50, 3, 3]
    parts = micro_batch_rows(range(4), lengths, micro_batch_size=4, max_tokens=10)
    assert parts == [[0], [1], [2, 3]]
    # The very first row over budget too.
    assert micro_batch_rows([0], [99], micro_batch_size=1, max_tokens=10) == [[0]]


def test_micro_batch_rows_over_budget_group_alone():
    # Group [2, 3] has a row of 20 > budget 16: it is its own micro-batch, whole.
    lengths = [2, 2, 2, 20, 2, 2]
    parts = micro_batch_rows(range(6), lengths, micro_batch_size=2, max_tokens=16, group_size=2)
    assert parts == [[0, 1], [2, 3], [4, 5]]


def test_micro_batch_rows_groups_by_count():
    rows = list(range(12))
    lengths = [3] * 12
    # group_size 3, micro_batch_size 6: two groups per micro-batch.
    assert micro_batch_rows(rows, lengths, micro_batch_size=6, group_size=3) == [rows[0:6], rows[6:12]]
    # micro_batch_size 9: three groups, then the last one.
    assert micro_batch_rows(rows, lengths, micro_batch_size=9, group_size=3) == [rows[0:9], rows[9:12]]
    # micro_batch_size 4 with groups of 4: one group per micro-batch.
    assert micro_batch_rows(rows, lengths, micro_batch_size=4, group_size=4) == [rows[0:4], rows[4:8], rows[8:12]]


@pytest.mark.parametrize(("mbs", "group_size"), [(2, 4), (6, 4), (5, 3)])
def test_micro_batch_rows_refuses_a_size_that_is_not_a_multiple_of_the_group(mbs, group_size):
    """Counting rows with whole groups, a micro-batch size that is not a multiple of the group size was silently
    exceeded (2 with groups of 4 gave micro-batches of 4); it is an internal contract: raise instead."""
    with pytest.raises(ValueError, match=f"micro_batch_size={mbs} is not a multiple of group_size={group_size}"):
        micro_batch_rows(list(range(12)), [3] * 12, micro_batch_size=mbs, group_size=group_size)
    # With a token budget micro_batch_size is not used: nothing to check.
    parts = micro_batch_rows(list(range(12)), [3] * 12, micro_batch_size=mbs, max_tokens=24, group_size=group_size)
    check_partition(parts, range(12))


def test_micro_batch_rows_refuses_rows_that_split_a_group():
    """Rows that are not whole groups would leave a partial 'group' at the end, cut as if it were whole."""
    with pytest.raises(ValueError, match="7 rows are not whole groups of 2"):
        micro_batch_rows(list(range(7)), [3] * 7, micro_batch_size=4, group_size=2)


def test_micro_batch_rows_groups_by_tokens():
    # Without groups the budget of 12 cuts after row 2 (3 x 4), inside group [2, 3]; with groups of 2 it must cut
    # at a boundary, and [2, 3, 4, 5] would be 4 x 4 = 16 > 12.
    lengths = [4, 4, 4, 4, 1, 1]
    assert micro_batch_rows(range(6), lengths, micro_batch_size=1, max_tokens=12) == [[0, 1, 2], [3, 4, 5]]
    parts = micro_batch_rows(range(6), lengths, micro_batch_size=2, max_tokens=12, group_size=2)
    assert parts == [[0, 1], [2, 3], [4, 5]]
    # Budget 16: two groups of longest 4 fit (4 x 4); adding the third would be 6 x 4 = 24.
    parts = micro_batch_rows(range(6), lengths, micro_batch_size=2, max_tokens=16, group_size=2)
    assert parts == [[0, 1, 2, 3], [4, 5]]
    # Short groups first: they share a micro-batch until a long group would exceed the budget.
    lengths = [1, 1, 1, 1, 4, 4]
    parts = micro_batch_rows(range(6), lengths, micro_batch_size=2, max_tokens=8, group_size=2)
    assert parts == [[0, 1, 2, 3], [4, 5]]


LENGTH_SETS = [
    [7, 3, 9, 1, 4, 4, 12, 2, 5, 6, 8, 3],
    [1] * 12,
    [20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 30],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
]


@pytest.mark.parametrize("lengths", LENGTH_SETS)
@pytest.mark.parametrize("group_size", [None, 1, 2, 3, 4])
def test_micro_batch_rows_properties(lengths, group_size):
    rows = list(range(len(lengths)))
    unit = group_size or 1
    for mbs, budget in itertools.product([1, 2, 4, 6, 12], [None, 8, 16, 30, 100]):
        if group_size and mbs % group_size and budget is None:
            continue  # micro_batch_size must be a multiple of the group size
        parts = micro_batch_rows(rows, lengths, micro_batch_size=mbs, max_tokens=budget, group_size=group_size)
        check_partition(parts, rows)
        for k, p in enumerate(parts):
            assert p[0] % unit == 0 and len(p) % unit == 0  # cuts only at group boundaries
            longest = max(lengths[i] for i in p)
            if budget is None:
                assert len(p) <= mbs
            elif len(p) > unit:
                assert len(p) * longest <= budget
            if k + 1 < len(parts):
                # Greedy: the next unit would not have fitted.
                nxt = parts[k + 1][:unit]
                grown = len(p) + len(nxt)
                if budget is None:
                    assert grown > mbs
                else:
                    assert grown * max(longest, *(lengths[i] for i in nxt)) > budget


# --- pad_rows -------------------------------------------------------------------------------------------------------


def test_pad_rows_shapes_values_and_mask():
    batch = make_batch([2, 3, 1], [3, 1, 2])  # lengths 5, 4, 3
    tokens, mask, index = pad_rows(batch, [2, 0], pad_id=-7)
    assert tokens.shape == mask.shape == (2, 5)
    assert tokens.dtype == torch.long and mask.dtype == torch.bool and index.dtype == torch.long
    assert tokens.tolist() == [[300, 301, 302, -7, -7], [100, 101, 102, 103, 104]]
    assert mask.tolist() == [[False, True, True, False, False], [False, False, True, True, True]]
    assert index.tolist() == [2, 0]


def test_pad_rows_default_pad_id_is_zero():
    batch = make_batch([1, 1], [1, 3])
    tokens, _, _ = pad_rows(batch, [0, 1])
    assert tokens[0].tolist() == [100, 101, 0, 0]


@pytest.mark.parametrize("rows", [[0], [1, 3], [3, 2, 1, 0], [2, 2]])
def test_pad_rows_mask_is_response_span(rows):
    batch = make_batch([3, 1, 4, 2], [2, 5, 1, 3])
    tokens, mask, index = pad_rows(batch, rows)
    for j, i in enumerate(rows):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        expect = [p <= k < p + r for k in range(tokens.shape[1])]
        assert mask[j].tolist() == expect
        assert tokens[j, : p + r].tolist() == batch.sequences[i]
        assert (tokens[j, p + r :] == 0).all()
        assert index[j] == i
    assert mask.sum() == sum(int(batch.response_lens[i]) for i in rows)


def test_pad_rows_refuses_fewer_rows_than_responses():
    """``num_rows < len(rows)`` silently dropped the responses past ``num_rows`` (their loss never computed)."""
    batch = make_batch([2, 1, 1], [1, 2, 1])
    with pytest.raises(ValueError, match="num_rows=2 is fewer than the 3 responses"):
        pad_rows(batch, [0, 1, 2], num_rows=2)
    assert pad_rows(batch, [0, 1, 2], num_rows=3)[2].tolist() == [0, 1, 2]


def test_pad_rows_refuses_a_length_shorter_than_a_response():
    batch = make_batch([2, 1, 1], [1, 2, 1])  # lengths 3, 3, 2
    with pytest.raises(ValueError, match="length=2 is shorter than response 0"):
        pad_rows(batch, [2, 0], length=2)


def test_pad_rows_explicit_num_rows_and_length():
    batch = make_batch([2, 1, 1], [1, 2, 1])  # lengths 3, 3, 2
    tokens, mask, index = pad_rows(batch, [2, 1], num_rows=4, length=6, pad_id=9)
    assert tokens.shape == mask.shape == (4, 6)
    assert index.tolist() == [2, 1, -1, -1]
    assert tokens.tolist() == [
        [300, 301, 9, 9, 9, 9],
        [200, 201, 202, 9, 9, 9],
        [300, 301, 9, 9, 9, 9],  # padding rows copy row 0 of the micro-batch (response 2) ...
        [300, 301, 9, 9, 9, 9],
    ]
    assert mask[:2].tolist() == [
        [False, True, False, False, False, False],
        [False, True, True, False, False, False],
    ]
    assert not mask[2:].any()  # ... with an empty mask


def test_pad_rows_length_only():
    batch = make_batch([1], [1])
    tokens, mask, index = pad_rows(batch, [0], length=4)
    assert tokens.tolist() == [[100, 101, 0, 0]]
    assert mask.tolist() == [[False, True, False, False]]
    assert index.tolist() == [0]


def test_pad_rows_micro_batches_of_a_step():
    # End to end: the micro-batches of a step padded to one shape hold every response's tokens once.
    batch = make_batch([2, 2, 3, 3, 1, 1, 2, 2], [1, 4, 2, 2, 5, 1, 1, 3], group_size=2)
    lengths = [len(s) for s in batch.sequences]
    rows = [i for m in mini_batch_rows(batch.num_prompts, 2, 2, 0, 1) for i in m]
    parts = micro_batch_rows(rows, lengths, micro_batch_size=4, max_tokens=14, group_size=2)
    num_rows, length = max(len(p) for p in parts), max(lengths)
    seen = []
    for p in parts:
        tokens, mask, index = pad_rows(batch, p, num_rows=num_rows, length=length)
        assert tokens.shape == (num_rows, length)
        real = index >= 0
        seen += index[real].tolist()
        assert int(mask.sum()) == sum(int(batch.response_lens[i]) for i in p)
    assert seen == list(range(8))


# --- routed experts (router replay) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_routed_experts_travel_token_aligned_through_share_padding_and_packing(packing):
    """Each sequence's engine routing (``L_i - 1`` tokens, as vLLM gives) stays on its tokens through a
    data-parallel share and the step's padded or packed micro-batches: -1 at the last token and at padding."""
    from megatron_pacs.config import BatchConfig
    from megatron_pacs.data.layout import StepLayout

    prompt_lens, response_lens, layers, k = [3, 2, 4, 1], [2, 5, 1, 3], 2, 2
    lengths = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    seqs = [[100 * (i + 1) + t for t in range(n)] for i, n in enumerate(lengths)]
    # token t of sequence i is routed to experts (tokens' value mod 50, + layer), k of them
    routing = [
        torch.tensor(s[:-1])[:, None, None] % 50 + torch.arange(layers)[:, None] + torch.zeros(k, dtype=torch.long)
        for s in seqs
    ]
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor(prompt_lens), torch.tensor(response_lens), torch.ones(4), 2, routed_experts=routing
    )
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.int16
    share = batch.share([2, 3])
    assert share.routed_experts is not None and share.routed_experts.shape[0] == lengths[2] + lengths[3]
    cfg = BatchConfig(
        ppo_mini_batch_size=2, micro_batch_size=2, sequence_packing=packing, global_batch_size=2, group_size=2
    )
    layout = StepLayout(share, cfg, dp_rank=1, dp_size=2, pp_size=1, interleaved=False, whole_groups=False)
    seen = 0
    for mb in layout.micro_batches([0]):
        assert mb.routed_experts is not None and mb.routed_experts.shape[:2] == mb.tokens.shape
        tokens, routed = mb.tokens.reshape(-1), mb.routed_experts.reshape(-1, layers, k).long()
        real = routed[:, 0, 0] >= 0
        # where given, the routing names the token it sits on; -1 exactly at last tokens and padding
        assert torch.equal(routed[real, 1, 0], tokens[real] % 50 + 1)
        seen += int(real.sum())
    assert seen == lengths[2] - 1 + lengths[3] - 1
    assert (
        RolloutBatch.from_sequences(
            seqs, torch.tensor(prompt_lens), torch.tensor(response_lens), torch.ones(4), 2
        ).routed_experts
        is None
    )
