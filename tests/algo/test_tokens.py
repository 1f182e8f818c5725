"""Micro-batches and their scored tokens: where the scored tokens sit in either layout, the flat view every
objective receives, float64 sequence sums, the token store's gather and put."""

import pytest
import torch

from megatron_pacs.algo import masked_sequence_sum
from megatron_pacs.algo.tokens import MicroBatch, TokenLogprobs, TokenStore, make_micro_batches


def _flat(lengths: list[int], logp: torch.Tensor) -> TokenLogprobs:
    lens = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    rank = torch.cat([torch.arange(n) for n in lengths])
    return TokenLogprobs(logp=logp, seq=seq, rank=rank, index=torch.arange(len(lengths)), lengths=lens)


def test_a_4k_token_score_keeps_float64_precision():
    """A PACS score is beta * (l - l_anchor), two sums of thousands of fp32 token log-probs that nearly cancel.
    Summed in float64 the difference matches the float64 sum of per-token differences (the reference's order) to
    1e-9 at 4,096 tokens; summed in float32 first, it is off by ~1e-4 (docs/algorithm.md §2.1)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    current = -torch.rand(n, generator=gen) * 3  # fp32, |l| ~ 6,000 nats
    anchor = current + 1e-3 * torch.randn(n, generator=gen)
    truth = (current.double() - anchor.double()).sum().item()
    ours = (_flat([n], current).sequence_sums() - _flat([n], anchor).sequence_sums()).item()
    assert abs(ours - truth) <= 1e-9
    fp32 = (current.sum() - anchor.sum()).item()
    assert abs(fp32 - truth) > 1e-6  # what float32 sums lose, for scale
    mask = torch.ones(1, n, dtype=torch.bool)
    padded = (masked_sequence_sum(current[None], mask) - masked_sequence_sum(anchor[None], mask)).item()
    assert abs(padded - truth) <= 1e-9


def test_sequence_sums_are_per_sequence_and_differentiable():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.25, -0.25], requires_grad=True)
    tokens = _flat([2, 1, 3], logp)
    sums = tokens.sequence_sums()
    assert sums.dtype == torch.float64 and sums.tolist() == [-3.0, -0.5, -3.5]
    (sums * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert logp.grad is not None and logp.grad.tolist() == [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_token_store_gathers_and_puts_by_response_and_rank():
    store = TokenStore.zeros(torch.tensor([2, 1, 3]), "cpu")
    tokens = _flat([3, 2], torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]))
    tokens.index = torch.tensor([2, 0])  # this micro-batch holds responses 2 and 0, in that order
    store.put(tokens, tokens.logp)
    assert store.response(2).tolist() == [-1.0, -2.0, -3.0]
    assert store.response(0).tolist() == [-4.0, -5.0]
    assert store.response(1).tolist() == [0.0]
    assert store.gather(tokens).tolist() == tokens.logp.tolist()


def _logp(b: int, length: int) -> torch.Tensor:
    """``[b, L - 1]`` stand-in log-probs whose value encodes the position: ``row * 100 + column``."""
    return (torch.arange(b)[:, None] * 100 + torch.arange(length - 1)[None]).double()


def test_padded_rows_flatten_sequence_after_sequence_and_skip_padding_rows():
    tokens = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.tensor(
        [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.bool
    )  # row 1: a pipeline padding row
    mb = MicroBatch(tokens, mask, torch.tensor([7, -1, 4]))
    scored = mb.scored(_logp(3, 6))
    # token at column c is predicted at column c - 1
    assert scored.logp.tolist() == [1.0, 2.0, 200.0, 201.0, 202.0, 203.0]
    assert scored.seq.tolist() == [0, 0, 1, 1, 1, 1] and scored.rank.tolist() == [0, 1, 0, 1, 2, 3]
    assert scored.index.tolist() == [7, 4] and scored.lengths.tolist() == [2, 4]
    assert scored.sequence_sums().tolist() == [3.0, 806.0]
    assert mb.sequence_index.tolist() == [7, 4] and not mb.packed
    assert mb.num_padding == 18 - 4 - 5  # the padding row and the two rows' tails (sequences of 4 and 5 tokens)


def test_packed_rows_flatten_by_sequence_boundaries_and_restart_positions():
    tokens = torch.arange(10)[None]
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)  # sequences of 3 and 5, 2 padding
    mb = MicroBatch(tokens, mask, torch.tensor([5, 2]), seqlens=(3, 5))
    scored = mb.scored(_logp(1, 10))
    assert scored.logp.tolist() == [0.0, 1.0, 4.0, 5.0, 6.0]
    assert scored.seq.tolist() == [0, 0, 1, 1, 1] and scored.rank.tolist() == [0, 1, 0, 1, 2]
    assert scored.index.tolist() == [5, 2] and scored.lengths.tolist() == [2, 3]
    assert mb.position_ids().tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert mb.packed and mb.num_padding == 2


def test_gradients_flow_back_to_the_token_positions():
    logp = torch.zeros(1, 9, requires_grad=True)
    mb = MicroBatch(
        torch.zeros(1, 10, dtype=torch.long),
        torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]]).bool(),
        torch.tensor([0, 1]),
        seqlens=(3, 5),
    )
    scored = mb.scored(logp)
    (scored.sequence_sums() * torch.tensor([2.0, -1.0], dtype=torch.float64)).sum().backward()
    assert logp.grad.tolist() == [[2.0, 2.0, 0.0, 0.0, -1.0, -1.0, -1.0, 0.0, 0.0]]


def test_an_empty_packed_row_scores_nothing():
    mb = MicroBatch(
        torch.zeros(1, 4, dtype=torch.long),
        torch.zeros(1, 4, dtype=torch.bool),
        torch.zeros(0, dtype=torch.long),
        seqlens=(),
    )
    scored = mb.scored(torch.zeros(1, 3, requires_grad=True))
    assert scored.logp.numel() == 0 and scored.sequence_sums().numel() == 0 and mb.num_padding == 4


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="must be one"):
        MicroBatch(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool), torch.arange(2))
    with pytest.raises(ValueError, match="one row with one length per index entry"):
        MicroBatch(
            torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.bool), torch.arange(2), seqlens=(4,)
        )
    with pytest.raises(ValueError, match="padding rows"):
        MicroBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), torch.tensor([-1]))


def test_make_micro_batches_keeps_index_and_mask_on_the_tokens_device():
    tokens = torch.arange(12).view(3, 4)
    mbs = make_micro_batches(tokens, torch.ones_like(tokens, dtype=torch.bool), 2)
    assert [mb.index.tolist() for mb in mbs] == [[0, 1], [2, -1]]
    assert not mbs[1].score_mask[1].any()
