"""The flat scored-token view: float64 sequence sums, the token store's gather and put."""

import torch

from megatron_pacs.algo import masked_sequence_sum
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore


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
