"""Two-phase group gradient: the closed-form dL/ds, back-propagated through any micro-batching, is exact."""

import pytest
import torch

from megatron_pacs.algo import (
    ADVANTAGES,
    WEIGHTS,
    compute_scores,
    masked_sequence_sum,
    pacs_loss,
    pacs_score_grads,
    pacs_surrogate,
)


def batch(num_groups, n, seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randn(num_groups * n, generator=g, dtype=torch.float64)
    old = seq + 0.5 * torch.randn(num_groups * n, generator=g, dtype=torch.float64)
    r = (torch.rand(num_groups * n, generator=g) > 0.4).double()
    return seq, old, r


@pytest.mark.parametrize("advantage", ADVANTAGES.names())
@pytest.mark.parametrize("weights", WEIGHTS.names())
@pytest.mark.parametrize("score", ["log_ratio", "mean_logp"])
def test_score_grads_equal_autograd(advantage, weights, score):
    n, beta = 4, 1.3
    seq, old, r = batch(5, n, seed=11)
    lens = torch.arange(1, seq.numel() + 1, dtype=torch.float64)
    seq.requires_grad_(True)
    out = pacs_loss(
        seq, old, r, group_size=n, beta=beta, score=score, advantage=advantage, weights=weights, response_lens=lens
    )
    (g_direct,) = torch.autograd.grad(out.loss, seq)
    with torch.no_grad():
        s = compute_scores(seq, old, beta=beta, score=score, response_lens=lens)
    c = pacs_score_grads(s, r, group_size=n, advantage=advantage, weights=weights, normalizer=seq.numel())
    # Groups split across micro-batches of sizes 3, 7, 1, 9 (not multiples of n).
    g_two_phase = torch.zeros_like(seq)
    start = 0
    for size in (3, 7, 1, 9):
        sl = slice(start, start + size)
        part = seq.detach()[sl].clone().requires_grad_(True)
        s_mb = compute_scores(part, old[sl], beta=beta, score=score, response_lens=lens[sl])
        pacs_surrogate(s_mb, c[sl]).backward()
        g_two_phase[sl] = part.grad
        start += size
    assert start == seq.numel()
    torch.testing.assert_close(g_two_phase, g_direct, rtol=1e-10, atol=1e-13)


def test_grpo_score_grads_finite_when_scores_are_equal():
    """At theta == theta_old the scores are all 0: autograd through std gives NaN, the closed form does not."""
    s = torch.zeros(8, dtype=torch.float64)
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    c = pacs_score_grads(s, r, group_size=4, advantage="grpo", weights="balanced", normalizer=8)
    assert torch.isfinite(c).all()
    # Only the centring term survives: c = (e - mean e) / eps.
    w = torch.tensor([2, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 2, 2 / 3], dtype=torch.float64)
    e = (w * (0.5 - r) / 8).view(2, 4)
    torch.testing.assert_close(c.view(2, 4), (e - e.mean(-1, keepdim=True)) / 1e-6)


class TinyPolicy(torch.nn.Module):
    """A bigram language model: enough to give every response a differentiable sequence log-prob."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def seq_logp(self, tokens, mask):
        logits = self.out(torch.tanh(self.emb(tokens[:, :-1])))
        tok = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return masked_sequence_sum(tok, mask[:, 1:])


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_two_phase_through_a_model_equals_the_direct_gradient(advantage):
    """Parameter gradients: the whole-batch PACS loss vs phase 1 + surrogate over token-budget micro-batches."""
    torch.manual_seed(0)
    n, num_groups, T = 4, 6, 9
    model = TinyPolicy().double()
    tokens = torch.randint(0, 11, (n * num_groups, T))
    lengths = torch.randint(3, T + 1, (n * num_groups,))
    mask = torch.arange(T)[None] < lengths[:, None]
    r = (torch.rand(n * num_groups) > 0.5).double()
    with torch.no_grad():
        old = model.seq_logp(tokens, mask) + 0.2 * torch.randn(n * num_groups, dtype=torch.float64)

    model.zero_grad()
    pacs_loss(model.seq_logp(tokens, mask), old, r, group_size=n, beta=2.0, advantage=advantage).loss.backward()
    direct = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    with torch.no_grad():
        s = compute_scores(model.seq_logp(tokens, mask), old, beta=2.0)
    c = pacs_score_grads(s, r, group_size=n, advantage=advantage, normalizer=n * num_groups)
    for idx in torch.randperm(n * num_groups).split(5):  # shuffled, group-splitting micro-batches
        pacs_surrogate(compute_scores(model.seq_logp(tokens[idx], mask[idx]), old[idx], beta=2.0), c[idx]).backward()
    for p, g in zip(model.parameters(), direct, strict=False):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12)


def test_score_grads_errors():
    with pytest.raises(ValueError, match="normalizer=0"):
        pacs_score_grads(torch.zeros(4), torch.zeros(4), group_size=2, normalizer=0)
    with pytest.raises(ValueError, match="not a multiple"):
        pacs_score_grads(torch.zeros(5), torch.zeros(5), group_size=2, normalizer=5)
    with pytest.raises(ValueError, match="must have one shape"):
        pacs_surrogate(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_sample_weights_scale_each_response_in_both_the_loss_and_the_closed_form(advantage):
    """Off-policy importance weights (docs/algorithm.md §5.1) multiply each response's BCE weight; the two-phase
    coefficients with the same weights are still the exact gradient."""
    n = 4
    seq, old, r = batch(3, n, seed=5)
    rho = torch.linspace(0.5, 2.0, seq.numel(), dtype=torch.float64)
    seq.requires_grad_(True)
    out = pacs_loss(seq, old, r, group_size=n, advantage=advantage, sample_weights=rho)
    plain = pacs_loss(seq.detach(), old, r, group_size=n, advantage=advantage)
    assert out.loss_sum.item() != pytest.approx(plain.loss_sum.item())
    (g_direct,) = torch.autograd.grad(out.loss, seq)
    with torch.no_grad():
        s = compute_scores(seq, old)
    c = pacs_score_grads(s, r, group_size=n, advantage=advantage, normalizer=seq.numel(), sample_weights=rho)
    part = seq.detach().clone().requires_grad_(True)
    pacs_surrogate(compute_scores(part, old), c).backward()
    torch.testing.assert_close(part.grad, g_direct, rtol=1e-10, atol=1e-13)
    ones = pacs_loss(seq.detach(), old, r, group_size=n, advantage=advantage, sample_weights=torch.ones_like(rho))
    assert ones.loss_sum.item() == plain.loss_sum.item()
