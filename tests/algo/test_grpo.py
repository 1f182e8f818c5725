"""GRPO baseline: advantages by hand, PPO clipping, sum/count invariance across micro-batches."""

import math

import pytest
import torch

from megatron_pacs.algo import grpo_advantages, grpo_loss, reduce_metrics


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(r, group_size=4)
    sd = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    assert adv[:4].tolist() == pytest.approx([0.75 / (sd + 1e-6)] + [-0.25 / (sd + 1e-6)] * 3, rel=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # an all-correct group has no signal
    assert grpo_advantages(r, group_size=4, norm_by_std=False)[:4].tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_on_policy_loss_is_minus_advantage_token_sum_over_tmax():
    logp = torch.randn(4, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    out = grpo_loss(logp.clone().requires_grad_(True), logp, mask, adv, max_response_len=8)
    expected = -(adv * mask.sum(-1)).sum() / 8
    assert out.loss_sum.item() == pytest.approx(expected.item())
    assert out.count == 4


def test_clipping():
    old = torch.zeros(2, 1, dtype=torch.float64)
    new = torch.full((2, 1), math.log(1.5), dtype=torch.float64, requires_grad=True)  # ratio 1.5 > 1 + 0.2
    out = grpo_loss(new, old, torch.ones(2, 1), torch.tensor([1.0, -1.0]), max_response_len=1)
    (g,) = torch.autograd.grad(out.loss_sum, new)
    # positive advantage: clipped at 1.2, no gradient; negative advantage: unclipped -A * ratio = 1.5, grad 1.5
    assert out.loss_sum.item() == pytest.approx(-1.2 + 1.5)
    assert g.flatten().tolist() == pytest.approx([0.0, 1.5])
    m = reduce_metrics([out.metrics])
    assert m["grpo/clip_frac"] == 0.5


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(10.0))
    out = grpo_loss(new, old, torch.ones(1, 1), torch.tensor([-1.0]), max_response_len=1, clip_ratio_c=3.0)
    assert out.loss_sum.item() == pytest.approx(3.0)
    out = grpo_loss(new, old, torch.ones(1, 1), torch.tensor([-1.0]), max_response_len=1, clip_ratio_c=None)
    assert out.loss_sum.item() == pytest.approx(10.0)


def test_microbatch_invariance_and_padding_independence():
    torch.manual_seed(0)
    S, T = 12, 7
    logp = (torch.randn(S, T, dtype=torch.float64) * 0.1).requires_grad_(True)
    old = torch.randn(S, T, dtype=torch.float64) * 0.1
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (S,))[:, None]
    adv = grpo_advantages((torch.rand(S) > 0.5).double(), group_size=4)
    whole = grpo_loss(logp, old, mask, adv, max_response_len=16)
    (g_whole,) = torch.autograd.grad(whole.loss, logp)
    parts = [
        grpo_loss(logp[i : i + 5], old[i : i + 5], mask[i : i + 5], adv[i : i + 5], max_response_len=16)
        for i in range(0, S, 5)
    ]
    loss = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    (g_parts,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, whole.loss)
    torch.testing.assert_close(g_parts, g_whole)
    # Extra padding columns (with garbage values) change nothing.
    pad = torch.full((S, 3), float("nan"), dtype=torch.float64)
    padded = grpo_loss(
        torch.cat([logp, pad], 1),
        torch.cat([old, pad], 1),
        torch.cat([mask, torch.zeros(S, 3, dtype=torch.bool)], 1),
        adv,
        max_response_len=16,
    )
    torch.testing.assert_close(padded.loss, whole.loss)


def test_errors():
    with pytest.raises(ValueError, match="group_size=1 is too small"):
        grpo_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="share one"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), torch.zeros(2), max_response_len=3)
    with pytest.raises(ValueError, match="max_response_len=0"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2), max_response_len=0)
    with pytest.raises(ValueError, match="advantages contains NaN"):
        grpo_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(2, 3),
            torch.tensor([0.0, float("nan")]),
            max_response_len=3,
        )


def test_our_clip_of_one_eighth_is_verls_clip_of_one_at_micro_batch_eight():
    """verl's seq-mean-token-sum-norm sums each micro-batch's responses and averages micro-batches (gradient
    accumulation): its GRPO gradient is ours times the per-GPU micro-batch size B. With B = 8 (the reference
    recipe), our --clip-grad 0.125 clips exactly where verl's grad_clip 1.0 does, to the same direction and to the
    same Adam update; the examples' GRPO recipes use it.

    Both clips here are ``torch.nn.utils.clip_grad_norm_`` (what verl's FSDP actor calls); that our Megatron
    optimizer step clips by exactly that rule is tested on a real model in
    ``tests/mcore/test_optim.py::test_train_steps_match_torch_adamw_with_per_token_normalisation[clip]`` (1e-6)."""
    import re
    from pathlib import Path

    micro, num, t_max = 8, 32, 6
    gen = torch.Generator().manual_seed(0)
    theta = (-torch.rand(num, t_max, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    old = theta.detach() + 0.05 * torch.randn(num, t_max, generator=gen, dtype=torch.float64)
    mask = torch.arange(t_max)[None] < torch.randint(1, t_max + 1, (num, 1), generator=gen)
    adv = grpo_advantages((torch.rand(num, generator=gen) > 0.5).float(), group_size=8).double()
    ours = grpo_loss(theta, old, mask, adv, max_response_len=t_max)
    (g_ours,) = torch.autograd.grad(ours.loss_sum / ours.count, theta)
    verl = 0.0  # per micro-batch: sum over its responses of token-sum / T_max, divided by the accumulation steps
    for s in range(0, num, micro):
        part = grpo_loss(
            theta[s : s + micro], old[s : s + micro], mask[s : s + micro], adv[s : s + micro], max_response_len=t_max
        )
        verl = verl + part.loss_sum / (num // micro)
    (g_verl,) = torch.autograd.grad(verl, theta)
    torch.testing.assert_close(g_verl, micro * g_ours)

    def clipped(g, max_norm):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], max_norm)
        return p.grad

    recipe = Path(__file__).resolve().parents[2] / "examples" / "qwen2.5-7b" / "grpo.sh"
    match = re.search(r"--clip-grad ([0-9.]+)", recipe.read_text())
    assert match is not None and float(match.group(1)) == 1.0 / micro  # verl's 1.0, in our scale
    verl_clip = 0.1  # below this toy gradient's norm, so the clip is active (as verl's 1.0 is on a real model)
    assert g_verl.norm().item() > verl_clip
    # The clip coefficient c / (norm + 1e-6) is not scale-invariant in its epsilon: ours is c / (norm_verl + B*1e-6),
    # a relative difference of at most (B - 1) * 1e-6 / norm.
    rel = 2 * (micro - 1) * 1e-6 / g_verl.norm().item()
    for c in (verl_clip, 10.0):  # active and inactive: ours at c / B clips exactly when and as verl's does
        torch.testing.assert_close(clipped(g_verl, c), micro * clipped(g_ours, c / micro), rtol=rel, atol=1e-12)
    clip = verl_clip / micro
    verl_clip_value = verl_clip
    updates = []
    for g in (clipped(g_verl, verl_clip_value), clipped(g_ours, clip)):
        p = torch.zeros_like(theta, requires_grad=True)
        opt = torch.optim.AdamW([p], lr=1e-3, eps=1e-12, weight_decay=0.0)
        p.grad = g.clone()
        opt.step()
        updates.append(p.detach())
    torch.testing.assert_close(updates[0], updates[1], rtol=rel, atol=1e-12)
