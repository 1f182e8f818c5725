"""PACS loss: hand-computed golden values, the analytic gradient, micro-batch invariance, edge cases, errors."""

import math

import pytest
import torch

from megatron_pacs.algo import (
    ADVANTAGES,
    WEIGHTS,
    compute_scores,
    group_weights,
    masked_sequence_sum,
    pacs_loss,
    reduce_metrics,
)
from megatron_pacs.algo.objectives import Logprobs, MiniBatch, PacsTwoPhase
from megatron_pacs.config import LossConfig


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# One group of n=4: l = [2, 0, 0, -2], l_old = 0, beta = 0.5 -> s = [1, 0, 0, -1]; rewards [1, 0, 0, 0] (k = 1).
L = torch.tensor([2.0, 0.0, 0.0, -2.0], dtype=torch.float64)
L_OLD = torch.zeros(4, dtype=torch.float64)
R = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
S_HAND = [1.0, 0.0, 0.0, -1.0]
SD = math.sqrt(2 / 3)  # unbiased std of s
A_HAND = {
    "rloo": [s + s / 3 for s in S_HAND],  # s_i - (sum s - s_i)/3 with sum s = 0
    "grpo": [s / (SD + 1e-6) for s in S_HAND],
    "grpo_no_std": S_HAND,
    "naive": S_HAND,
}
W_HAND = {
    "balanced": [2.0, 2 / 3, 2 / 3, 2 / 3],  # n/(2k) = 2 for the positive, n/(2(n-k)) = 2/3 for negatives
    "none": [1.0, 1.0, 1.0, 1.0],
    "only_positive": [1.0, 0.0, 0.0, 0.0],
    "only_negative": [0.0, 1.0, 1.0, 1.0],
}


def bce(a: float, r: float) -> float:
    return r * softplus(-a) + (1 - r) * softplus(a)


@pytest.mark.parametrize("advantage", sorted(A_HAND))
@pytest.mark.parametrize("weights", sorted(W_HAND))
def test_golden_values_by_hand(advantage, weights):
    expected = sum(w * bce(a, r) for w, a, r in zip(W_HAND[weights], A_HAND[advantage], R.tolist(), strict=False)) / 4
    out = pacs_loss(L, L_OLD, R, group_size=4, beta=0.5, advantage=advantage, weights=weights)
    assert out.count == 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_golden_mean_logp_score():
    lens = torch.tensor([4.0, 2.0, 1.0, 8.0], dtype=torch.float64)
    s = compute_scores(L, None, beta=2.0, score="mean_logp", response_lens=lens)
    assert s.tolist() == pytest.approx([1.0, 0.0, 0.0, -0.5])
    # naive + none: the BCE on s directly
    expected = (bce(1.0, 1) + bce(0.0, 0) * 2 + bce(-0.5, 0)) / 4
    out = pacs_loss(
        L, None, R, group_size=4, beta=2.0, score="mean_logp", advantage="naive", weights="none", response_lens=lens
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


def test_n2_rloo_balanced_by_hand():
    # s = [1, -1] -> A = [2, -2], w = [1, 1]; both terms are softplus(-2).
    out = pacs_loss(torch.tensor([1.0, -1.0]), torch.zeros(2), torch.tensor([1.0, 0.0]), group_size=2)
    assert out.loss.item() == pytest.approx(softplus(-2.0), rel=1e-6)


def test_balanced_weights_sum_to_group_size_and_single_class_is_one():
    r = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    w = group_weights(r, group_size=8, weights="balanced").view(2, 8)
    assert w[0].sum().item() == pytest.approx(8.0)
    assert w[0, :3].tolist() == pytest.approx([8 / 6] * 3) and w[0, 3:].tolist() == pytest.approx([8 / 10] * 5)
    r2 = torch.tensor([1.0] * 4 + [0.0] * 4)
    assert group_weights(r2, group_size=4, weights="balanced").tolist() == [1.0] * 8


def random_batch(num_groups, n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randn(num_groups * n, generator=g, dtype=dtype)
    old = seq + 0.3 * torch.randn(num_groups * n, generator=g, dtype=dtype)
    r = (torch.rand(num_groups * n, generator=g) > 0.5).to(dtype)
    return seq, old, r


def test_gradient_equals_analytic_formula_of_spec_1_8():
    """-dL/dl_i = (beta/M) * (e_i - mean_{j != i} e_j) with e_i = w_i (R_i - sigmoid(A_i)), rloo + log_ratio."""
    n, beta = 8, 1.7
    seq, old, r = random_batch(6, n, seed=3)
    seq.requires_grad_(True)
    out = pacs_loss(seq, old, r, group_size=n, beta=beta)
    (grad,) = torch.autograd.grad(out.loss, seq)
    s = (beta * (seq - old)).detach().view(-1, n)
    a = s - (s.sum(-1, keepdim=True) - s) / (n - 1)
    w = group_weights(r, group_size=n).view(-1, n).double()
    e = w * (r.view(-1, n) - torch.sigmoid(a))
    a_eff = e - (e.sum(-1, keepdim=True) - e) / (n - 1)
    expected = -(beta / seq.numel()) * a_eff.reshape(-1)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_first_minibatch_unweighted_gradient_is_rloo_on_reward():
    """At A = 0 (theta == theta_old) with no weights, the advantage is R_i - mean_{j != i} R_j.

    docs/algorithm.md §2.6.
    """
    n = 4
    seq = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    r = torch.tensor([1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.float64)
    out = pacs_loss(seq, torch.zeros(8, dtype=torch.float64), r, group_size=n, weights="none")
    (grad,) = torch.autograd.grad(out.loss, seq)
    rg = r.view(-1, n)
    rloo_adv = (rg - (rg.sum(-1, keepdim=True) - rg) / (n - 1)).reshape(-1)
    torch.testing.assert_close(-grad * seq.numel(), rloo_adv)


@pytest.mark.parametrize("advantage", ADVANTAGES.names())
@pytest.mark.parametrize("weights", WEIGHTS.names())
def test_microbatch_sum_equals_whole_batch(advantage, weights):
    """Summing loss_sum and count over whole-group micro-batches of unequal sizes gives the same loss and grad."""
    n = 4
    seq, old, r = random_batch(10, n, seed=5)
    seq.requires_grad_(True)
    whole = pacs_loss(seq, old, r, group_size=n, advantage=advantage, weights=weights)
    (g_whole,) = torch.autograd.grad(whole.loss, seq)
    parts, total_count, pieces = [], 0, [(0, 3), (3, 4), (4, 10)]  # in groups
    for lo, hi in pieces:
        sl = slice(lo * n, hi * n)
        out = pacs_loss(seq[sl], old[sl], r[sl], group_size=n, advantage=advantage, weights=weights)
        parts.append(out)
        total_count += out.count
    loss = sum(p.loss_sum for p in parts) / total_count
    (g_parts,) = torch.autograd.grad(loss, seq)
    torch.testing.assert_close(loss, whole.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-14)
    merged = reduce_metrics(p.metrics for p in parts)
    for key, value in reduce_metrics([whole.metrics]).items():
        assert merged[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key  # float32 metrics


@pytest.mark.parametrize("n", [2, 64])
def test_all_correct_and_all_wrong_groups(n):
    seq = torch.zeros(2 * n, dtype=torch.float64, requires_grad=True)
    r = torch.cat([torch.ones(n), torch.zeros(n)]).double()
    out = pacs_loss(seq, torch.zeros(2 * n, dtype=torch.float64), r, group_size=n)
    assert out.loss.item() == pytest.approx(math.log(2.0))  # A = 0, weight 1: BCE(0, R) = log 2
    (grad,) = torch.autograd.grad(out.loss, seq)
    assert grad.abs().max().item() == pytest.approx(0.0, abs=1e-15)  # no gradient from all-equal groups at A=0
    m = reduce_metrics([out.metrics])
    assert m["pacs/all_correct_groups"] == 0.5 and m["pacs/all_wrong_groups"] == 0.5
    assert m["pacs/critic_acc"] == 0.5  # every logit is exactly 0: half right


def test_bf16_inputs_are_upcast():
    seq, old, r = random_batch(4, 8, seed=1, dtype=torch.float32)
    ref = pacs_loss(seq.bfloat16().float(), old.bfloat16().float(), r, group_size=8)
    out = pacs_loss(seq.bfloat16(), old.bfloat16(), r.bfloat16(), group_size=8)
    assert out.loss_sum.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss)


def test_critic_metrics():
    # One group n=2: s = [3, 0] -> A = [3, -3]; response 0 correct.
    out = pacs_loss(torch.tensor([3.0, 0.0]), torch.zeros(2), torch.tensor([1.0, 0.0]), group_size=2)
    m = reduce_metrics([out.metrics])
    assert m["pacs/critic_p_correct"] == pytest.approx(1 / (1 + math.exp(-3)))
    assert m["pacs/critic_p_wrong"] == pytest.approx(1 / (1 + math.exp(3)))
    assert m["pacs/critic_acc"] == 1.0
    assert m["pacs/score/max"] == 3.0 and m["pacs/score/min"] == 0.0


def test_class_weights_and_importance_ratios_are_reported_apart():
    """pacs/weight is the class weight w (mean 1 under balanced, whatever the ratios); the truncated importance
    ratios multiplying it in the loss are pacs/tis_weight, in both the direct and the two-phase path."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ratios = torch.tensor([2.0, 0.5, 1.0, 1.5, 0.3, 1.0, 2.0, 0.9], dtype=torch.float64)
    seq = torch.tensor([-3.0, -2.0, -4.0, -1.0, -2.5, -0.5, -1.5, -2.0], dtype=torch.float64)
    direct = reduce_metrics([pacs_loss(seq, seq - 0.1, rewards, group_size=4, sample_weights=ratios).metrics])
    cfg = LossConfig(off_policy_correction="tis")
    mb = MiniBatch(torch.arange(8), rewards, torch.full((8,), 3), 4, fresh=True, importance=Logprobs(ratios))
    two_phase = reduce_metrics([PacsTwoPhase(cfg).prepare(mb).metrics])
    for m in (direct, two_phase):
        assert m["pacs/weight/mean"] == pytest.approx(1.0)
        assert m["pacs/tis_weight/mean"] == pytest.approx(float(ratios.mean()))
        assert m["pacs/tis_weight/max"] == 2.0 and m["pacs/tis_weight/min"] == pytest.approx(0.3)
    assert "pacs/tis_weight/mean" not in reduce_metrics([pacs_loss(seq, seq, rewards, group_size=4).metrics])


def test_masked_sequence_sum_ignores_padding_values():
    tok = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("nan"), 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sequence_sum(tok, mask).tolist() == [-3.0, -0.5]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_size": 3}, "not a multiple of group_size=3"),
        ({"group_size": 1}, "group_size=1 is too small"),
        ({"group_size": 1, "advantage": "grpo"}, "group_size=1 is too small"),
        ({"group_size": 2, "advantage": "ppo"}, r"advantage='ppo'.*\['grpo', 'grpo_no_std', 'naive', 'rloo'\]"),
        ({"group_size": 2, "weights": "question"}, r"weights='question'.*\['balanced', 'none'"),
        ({"group_size": 2, "score": "dpo"}, r"score='dpo'.*\['log_ratio', 'mean_logp'\]"),
        ({"group_size": 2, "score": "mean_logp"}, "needs response_lens"),
    ],
)
def test_errors_name_the_field(kwargs, match):
    seq, old, r = random_batch(2, 2)
    with pytest.raises(ValueError, match=match):
        pacs_loss(seq, old, r, **kwargs)


def test_error_rewards_outside_unit_interval_and_non_finite():
    seq, old, _ = random_batch(1, 4)
    with pytest.raises(ValueError, match=r"rewards must lie in \[0, 1\]"):
        pacs_loss(seq, old, torch.tensor([0.0, 1.0, 2.0, 0.0]), group_size=4)
    with pytest.raises(ValueError, match="rewards contains NaN"):
        pacs_loss(seq, old, torch.tensor([0.0, float("nan"), 1.0, 0.0]), group_size=4)
    bad = seq.clone()
    bad[2] = float("inf")
    with pytest.raises(ValueError, match="seq_logp contains NaN or inf"):
        pacs_loss(bad, old, torch.tensor([0.0, 1.0, 1.0, 0.0]), group_size=4)
    with pytest.raises(ValueError, match="needs seq_old_logp"):
        pacs_loss(seq, None, torch.tensor([0.0, 1.0, 1.0, 0.0]), group_size=4)
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        pacs_loss(seq, old[:3], torch.tensor([0.0, 1.0, 1.0, 0.0]), group_size=4)
