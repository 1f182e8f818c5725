"""Guards PPO's critic maths (algo/gae.py) against verl's definitions, re-derived here from
``verl/trainer/ppo/core_algos.py`` (``compute_gae_advantage_return``, ``compute_value_loss``) and
``verl/utils/torch_functional.py`` (``masked_mean``, ``masked_var``, ``masked_whiten``): random masks (right padding
and holes), garbage outside the mask, gamma and lambda != 1; the whitening's cross-rank reduction; NaN garbage."""

from __future__ import annotations

import pytest
import torch

from megatron_pacs.algo.gae import clipped_value_loss, explained_variance, gae_advantages, gae_returns, masked_whiten

# -- verl, re-derived ------------------------------------------------------------------------------------------------


def _verl_masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def _verl_masked_whiten(x, mask):
    mean = _verl_masked_mean(x, mask)
    centred = x - mean
    var = _verl_masked_mean(centred**2, mask)
    var = var * mask.sum() / (mask.sum() - 1)  # unbiased (Bessel)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """The masked recursion: values and TD errors of masked-out tokens are skipped."""
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    returns = advantages + values
    return _verl_masked_whiten(advantages, response_mask), returns


def _verl_value_loss(vpreds, values, returns, response_mask, cliprange_value):
    vpredclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped = torch.max(vf_losses1, vf_losses2)
    clipfrac = _verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return 0.5 * clipped, clipfrac


# -- inputs ----------------------------------------------------------------------------------------------------------


def _batch(seed: int, rows: int = 6, length: int = 11, holes: bool = False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, length + 1, (rows,), generator=g)
    mask = torch.arange(length)[None] < lens[:, None]
    if holes:  # observation tokens inside a response (verl's multi-turn case)
        mask &= torch.rand(rows, length, generator=g) > 0.25
        mask[:, 0] = True
    rewards = torch.zeros(rows, length)
    last = (torch.where(mask, torch.arange(length)[None], -1)).amax(1)
    rewards[torch.arange(rows), last] = (torch.rand(rows, generator=g) > 0.5).float()
    rewards += 0.05 * torch.randn(rows, length, generator=g) * mask  # a per-token (KL-style) term
    values = torch.randn(rows, length, generator=g)
    garbage = 1e3 * torch.randn(rows, length, generator=g)
    return mask, torch.where(mask, rewards, garbage), torch.where(mask, values, -garbage)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_verl_with_garbage_outside_the_mask(gamma, lam, holes):
    for seed in range(4):
        mask, rewards, values = _batch(seed, holes=holes)
        adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
        # verl multiplies by the mask, so it must be fed finite inputs; it then ignores them as well
        ref_adv, ref_ret = _verl_gae(rewards, values, mask.float(), gamma, lam)
        torch.testing.assert_close(adv[mask], ref_adv[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret[mask], ref_ret[mask], rtol=1e-5, atol=1e-5)
        assert not adv[~mask].any() and not ret[~mask].any()


def test_gae_at_gamma_lambda_one_is_reward_to_go_minus_value():
    """With gamma = lambda = 1 (the released run) the raw advantage is the reward-to-go minus V_t: a telescoping sum."""
    mask, rewards, values = _batch(7)
    adv, ret = gae_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = torch.where(mask, rewards, 0).flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv[mask], (to_go - values)[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret[mask], to_go[mask], rtol=1e-5, atol=1e-5)


def test_nan_outside_the_mask_never_reaches_a_result():
    mask, rewards, values = _batch(3, holes=True)
    clean_adv, clean_ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    nan = torch.full_like(rewards, float("nan"))
    adv, ret = gae_advantages(
        torch.where(mask, rewards, nan), torch.where(mask, values, nan), mask, gamma=0.95, lam=0.9
    )
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)
    loss, clipped = clipped_value_loss(torch.where(mask, values, nan), nan, nan, torch.zeros_like(mask), clip=0.5)
    assert not loss.any() and not clipped.any()


def test_whitening_over_ranks_equals_whitening_the_whole_step():
    """Rows split over two 'ranks' whose reduction is a sum over both: the step's mean and variance, not each
    share's."""
    mask, rewards, values = _batch(11, rows=8)
    whole, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    raw, _ = gae_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    shares = [slice(0, 3), slice(3, 8)]
    calls: list[list[torch.Tensor]] = [[], []]

    def reduce_for(i):
        def reduce(t):  # a two-rank all-reduce: each rank's call k is summed with the other's call k
            calls[i].append(t)
            other = 1 - i
            k = len(calls[i]) - 1
            theirs = shares[other]
            if k == 0:
                o = torch.stack([mask[theirs].sum().double(), torch.where(mask[theirs], raw[theirs].double(), 0).sum()])
            else:
                n = mask.sum().double()
                mean = torch.where(mask, raw.double(), 0).sum() / n
                o = torch.where(mask[theirs], raw[theirs].double() - mean, 0).pow(2).sum().reshape(1)
            return t + o

        return reduce

    for i, rows in enumerate(shares):
        part = masked_whiten(raw[rows], mask[rows], reduce=reduce_for(i))
        torch.testing.assert_close(part, whole[rows], rtol=1e-6, atol=1e-6)
        assert len(calls[i]) == 2


@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_clipped_value_loss_matches_verl(clip):
    for seed in range(4):
        mask, _, old = _batch(seed, holes=bool(seed % 2))
        g = torch.Generator().manual_seed(100 + seed)
        returns = torch.where(mask, torch.randn(mask.shape, generator=g), 7.0)
        values = (old + torch.randn(mask.shape, generator=g)).requires_grad_()
        loss, clipped = clipped_value_loss(values, old, returns, mask, clip=clip)
        ref, ref_clipfrac = _verl_value_loss(values, old, returns, mask.float(), clip)
        torch.testing.assert_close(loss[mask], ref[mask])
        assert not loss[~mask].any() and not clipped[~mask].any()
        torch.testing.assert_close(clipped[mask].float().mean(), ref_clipfrac)
        assert 0 < int(clipped.sum()) < int(mask.sum())  # both branches exercised
        (grad,) = torch.autograd.grad(loss.sum(), values)
        (ref_grad,) = torch.autograd.grad((ref * mask).sum(), values)
        torch.testing.assert_close(grad, ref_grad)


def test_explained_variance():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(r, r).item() == 1.0
    assert explained_variance(torch.full_like(r, float(r.mean())), r).item() == pytest.approx(0.0)


def test_refusals():
    mask, rewards, values = _batch(0)
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(rewards, values, mask, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae_advantages(rewards[:, :-1], values, mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="clip"):
        clipped_value_loss(values, values, values, mask, clip=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(values, torch.zeros_like(mask))
