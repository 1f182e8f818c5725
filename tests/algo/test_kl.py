"""KL to the reference policy: the estimators, their gradients (exactly zero at theta = theta_ref), and the
KLRegularized objective's normalisation (invariant to any micro-batch split, like every loss here)."""

import itertools

import pytest
import torch

from megatron_pacs.algo.kl import kl_estimate
from megatron_pacs.algo.objectives import KLRegularized, Logprobs, MiniBatch, PacsTwoPhase, build_objective
from megatron_pacs.algo.pacs import pacs_score_grads
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

N, S, T = 4, 16, 7


def _tokens(theta, mask, rows):
    idx = torch.tensor(rows)
    m = mask[idx]
    lengths = m.sum(-1)
    seq = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    rank = torch.cat([torch.arange(int(n)) for n in lengths])
    return TokenLogprobs(logp=theta[idx][m], seq=seq, rank=rank, index=idx, lengths=lengths)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_estimator_values_and_gradients(estimator):
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(50, generator=gen) * 3
    logp = (ref + 0.3 * torch.randn(50, generator=gen)).requires_grad_()
    value, surrogate = kl_estimate(logp, ref, estimator)
    r = ref - logp.detach()
    k3 = torch.exp(r) - r - 1
    assert k3.max().item() < 10.0  # inside verl's clamp of the k3 value
    expected = {"k1": -r, "k2": 0.5 * r**2, "k3": k3, "k3+": k3}[estimator]
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(surrogate.detach(), expected)
    (grad,) = torch.autograd.grad(surrogate.sum(), logp)
    # k1: score-function form, k1 * d log pi; k2: -r * d(-log pi)... = k1 * d log pi too; k3: (1 - exp(r))
    # k3+: k3's value, k2's gradient (straight through)
    want = {"k1": -r, "k2": -r, "k3": 1 - torch.exp(r), "k3+": -r}[estimator]
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_kl_value_and_gradient_are_exactly_zero_at_the_reference(estimator):
    logp = (-torch.rand(40) * 5).requires_grad_()
    value, surrogate = kl_estimate(logp, logp.detach().clone(), estimator)
    (grad,) = torch.autograd.grad(surrogate.sum(), logp)
    assert value.abs().max().item() == 0.0 and grad.abs().max().item() == 0.0


def test_which_kl_each_gradient_follows_in_expectation():
    """Exact expectations over a small vocabulary: k2's (and k3+'s, k1's) expected gradient is the gradient of
    KL(pi || pi_ref), the KL that ref/kl reports; k3's is the gradient of the reverse KL(pi_ref || pi)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)

    def expected_grad(estimator):
        logp = torch.log_softmax(logits, -1)
        _, surrogate = kl_estimate(logp, ref, estimator)
        # E_{y ~ pi}[grad surrogate(y)] = sum_y pi(y) grad surrogate(y): the sampling is not differentiated
        (g,) = torch.autograd.grad((logp.exp().detach() * surrogate.double()).sum(), logits)
        return g

    pi = torch.log_softmax(logits, -1)
    forward = (pi.exp() * (pi - ref)).sum()  # KL(pi || pi_ref)
    reverse = (ref.exp() * (ref - pi)).sum()  # KL(pi_ref || pi)
    (g_forward,) = torch.autograd.grad(forward, logits, retain_graph=True)
    (g_reverse,) = torch.autograd.grad(reverse, logits)
    for estimator in ("k1", "k2", "k3+"):
        torch.testing.assert_close(expected_grad(estimator), g_forward, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(expected_grad("k3"), g_reverse, atol=1e-6, rtol=1e-5)
    assert (g_forward - g_reverse).abs().max().item() > 1e-2  # a real difference away from the reference


def test_k3_value_is_clamped_at_10_as_verl_and_its_gradient_stops_there():
    ref = torch.zeros(3)
    logp = torch.tensor([-5.0, -25.0, -0.5]).requires_grad_()  # r = 5 (k3 ~ 142), r = 25 (beyond the r clamp)
    value, surrogate = kl_estimate(logp, ref, "k3")
    assert value[:2].tolist() == [10.0, 10.0]
    (grad,) = torch.autograd.grad(surrogate.sum(), logp)
    assert grad[:2].tolist() == [0.0, 0.0] and grad[2].item() != 0.0
    plus_value, plus = kl_estimate(logp, ref, "k3+")
    assert torch.equal(plus_value, value)
    (plus_grad,) = torch.autograd.grad(plus.sum(), logp)
    assert plus_grad.tolist() == pytest.approx([-5.0, 0.0, -0.5])  # k2's gradient -r; zero beyond |r| = 20


def test_k3_is_non_negative_and_refuses_unknown_estimators():
    value, _ = kl_estimate(torch.randn(100), torch.randn(100) * 3, "k3")
    assert value.min().item() >= 0.0
    with pytest.raises(ValueError, match="kl_estimator='k4' is not a valid option"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


def test_kl_regularised_objective_is_split_invariant_and_adds_coef_times_kl_over_t_max():
    gen = torch.Generator().manual_seed(3)
    theta = (-torch.rand(S, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    lens = torch.randint(1, T + 1, (S,), generator=gen)
    mask = torch.arange(T)[None] < lens[:, None]
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
    ref_tokens = theta.detach() + 0.2 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    ref = Logprobs(torch.where(mask, ref_tokens, 0.0).sum(-1), TokenStore(ref_tokens[mask].float(), offsets))
    loss_cfg = LossConfig(pacs_score_reference="ref", kl_coef=0.3, kl_estimator="k3")
    batch_cfg = BatchConfig(global_batch_size=4, group_size=N, ppo_mini_batch_size=4, max_response_length=T)
    obj = build_objective(loss_cfg, batch_cfg)
    assert isinstance(obj, KLRegularized) and obj.ref_logprobs == "token" and obj.old_logprobs is None
    assert obj.needs_current(fresh=True)  # a reference anchor is not 0 at the first mini-batch
    assert obj.loss_keys == ("pacs/loss", "ref/kl_loss")
    current = torch.where(mask, theta.detach(), 0.0).sum(-1)
    mb = MiniBatch(torch.arange(S), rewards, lens, N, fresh=True, ref=ref, current=current)
    prepared = obj.prepare(mb)
    totals = []
    for cuts in ([], [3], [5, 6, 11]):
        total, count, kl_value, kl_tokens = 0.0, 0, 0.0, 0
        for a, b in itertools.pairwise([0, *cuts, S]):
            loss_sum, cnt, report = prepared.loss(_tokens(theta, mask, list(range(a, b))))
            total = total + loss_sum.double()
            count += int(cnt)
            kl_value += float(report["ref/kl"][0])
            kl_tokens += int(report["ref/kl"][1])
        (g,) = torch.autograd.grad(total / count, theta)
        totals.append((g, kl_value / kl_tokens))
    for g, kl in totals[1:]:
        torch.testing.assert_close(g, totals[0][0], rtol=1e-5, atol=1e-7)
        assert kl == pytest.approx(totals[0][1], rel=1e-6)
    # the KL part of the gradient alone: coef * d(sum of k3 over all tokens) / T_max / S
    inner = PacsTwoPhase(loss_cfg).prepare(mb)
    inner_total = sum(inner.loss(_tokens(theta, mask, list(range(a, b))))[0].double() for a, b in [(0, S)])
    (g_inner,) = torch.autograd.grad(inner_total / S, theta)
    logp = theta[mask]
    _, surrogate = kl_estimate(logp, ref_tokens[mask], "k3")
    (g_kl,) = torch.autograd.grad(0.3 * surrogate.sum() / T / S, theta)
    torch.testing.assert_close(totals[0][0], g_inner + g_kl, rtol=1e-5, atol=1e-7)


def test_at_the_reference_the_v2_loss_equals_the_old_anchored_one_and_uniform_groups_get_no_gradient():
    """theta = theta_ref (step 1, or right after a reset): s = 0 exactly, as with the pi_old anchor at the first
    mini-batch, so the two PACS variants prepare the same coefficients; all-equal-reward groups get c = 0."""
    gen = torch.Generator().manual_seed(5)
    seq = -torch.rand(S, generator=gen, dtype=torch.float64) * 20
    rewards = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1], dtype=torch.float32)
    lens = torch.full((S,), 5)
    v2 = PacsTwoPhase(LossConfig(pacs_score_reference="ref"))
    v1 = PacsTwoPhase(LossConfig())
    a = v2.prepare(MiniBatch(torch.arange(S), rewards, lens, N, fresh=True, ref=Logprobs(seq), current=seq.clone()))
    b = v1.prepare(MiniBatch(torch.arange(S), rewards, lens, N, fresh=True))
    assert a.metrics["pacs/loss"].tolist() == b.metrics["pacs/loss"].tolist()
    assert a.metrics["pacs/score/max"][0].item() == 0.0 and a.metrics["pacs/score/min"][0].item() == 0.0
    c = pacs_score_grads(torch.zeros(S, dtype=torch.float64), rewards, group_size=N, normalizer=1.0)
    assert c[:8].abs().max().item() == 0.0  # groups 0 (all correct) and 1 (all wrong)
    assert c[8:].abs().min().item() > 0.0


@pytest.mark.parametrize("direct", [False, True])
def test_at_the_reference_with_four_mini_batches_scores_and_kl_are_exactly_zero_without_a_phase_1_pass(direct):
    """With several mini-batches the reference pass and the training pass cut the responses differently, so their
    log-probs differ by rounding (1e-6 here); where the parameters are the reference's (the first mini-batch at
    step 1 or after a reset: ``at_reference``) the score and the KL are set to 0 exactly, with no phase-1 pass and
    no KL gradient, whatever the reference pass's rounding; the later mini-batches compute them."""
    gen = torch.Generator().manual_seed(7)
    theta = (-torch.rand(S, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    lens = torch.randint(1, T + 1, (S,), generator=gen)
    mask = torch.arange(T)[None] < lens[:, None]
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
    ref_tokens = theta.detach() + 1e-6 * torch.randn(S, T, generator=gen, dtype=torch.float64)  # rounding only
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    ref = Logprobs(torch.where(mask, ref_tokens, 0.0).sum(-1), TokenStore(ref_tokens[mask].float(), offsets))
    loss_cfg = LossConfig(pacs_score_reference="ref", kl_coef=0.3)
    batch_cfg = BatchConfig(
        global_batch_size=4,
        group_size=N,
        ppo_mini_batch_size=1,
        max_response_length=T,
        keep_groups_in_microbatch=direct,
    )
    obj = build_objective(loss_cfg, batch_cfg)
    assert not obj.needs_current(fresh=True, at_reference=True)
    if not direct:  # direct mode scores in the training pass: never a phase 1
        assert obj.needs_current(fresh=True) and obj.needs_current(fresh=False)
    for k in range(4):  # four mini-batches of one group each; only the first is at the reference
        rows = list(range(k * N, (k + 1) * N))
        at_reference = k == 0
        current = None if direct or at_reference else torch.where(mask, theta.detach(), 0.0).sum(-1)
        mb = MiniBatch(torch.tensor(rows), rewards, lens, N, fresh=k == 0, ref=ref, current=current)
        mb.at_reference = at_reference
        prepared = obj.prepare(mb)
        loss_sum, _, report = prepared.loss(_tokens(theta, mask, rows))
        metrics = {**prepared.metrics, **report}
        if at_reference:
            assert report["ref/kl"][0].item() == 0.0 and report["ref/kl_loss"][0].item() == 0.0
            assert metrics["pacs/score/max"][0].item() == 0.0 and metrics["pacs/score/min"][0].item() == 0.0
            # the gradient is the PACS gradient at s = 0 alone: the same as with the KL term removed
            (g,) = torch.autograd.grad(loss_sum, theta)
            inner = build_objective(LossConfig(), batch_cfg)  # the pi_old anchor: s = 0 exactly when fresh
            plain = inner.prepare(MiniBatch(torch.tensor(rows), rewards, lens, N, fresh=True))
            (g_plain,) = torch.autograd.grad(plain.loss(_tokens(theta, mask, rows))[0], theta)
            assert torch.equal(g, g_plain)
        else:
            assert report["ref/kl"][0].item() > 0.0  # computed: the rounding shows
            assert metrics["pacs/score/max"][0].item() != 0.0


def test_a_single_class_group_gets_no_gradient_at_equal_scores_and_only_a_zero_sum_one_otherwise():
    """All-equal rewards: c = 0 whenever the group's scores are equal (theta = theta_anchor, or any common shift,
    since the rloo logits centre it away); with unequal scores (the v2 anchor between resets) c sums to 0 over the
    group, so the group's total log-likelihood gets no push, only its spread contracts (docs/algorithm.md §2.6)."""
    rewards = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    shifted = torch.tensor([3.0] * 4 + [-2.0] * 4, dtype=torch.float64)
    c = pacs_score_grads(shifted, rewards, group_size=N, normalizer=1.0)
    assert c.abs().max().item() == 0.0
    gen = torch.Generator().manual_seed(11)
    spread = torch.randn(8, generator=gen, dtype=torch.float64)
    c = pacs_score_grads(spread, rewards, group_size=N, normalizer=1.0)
    assert c.abs().min().item() > 0.0
    sums = c.view(2, N).sum(1)
    assert sums.abs().max().item() < 1e-15
    # the contraction: the lowest-scored correct response is pushed up most, the highest down (c = dL/ds)
    first = slice(0, N)
    assert int(c[first].argmin()) == int(spread[first].argmin()) and int(c[first].argmax()) == int(
        spread[first].argmax()
    )
