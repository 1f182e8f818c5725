"""megatron_pacs.algo.policy_losses / token_objectives: GRPO, GSPO and CISPO equal verl's definitions.

verl's ``agg_loss``, ``compute_policy_loss_vanilla`` and ``compute_policy_loss_gspo`` and MiniMax-M1's CISPO are
re-derived here on padded ``[B, T]`` tensors, over the whole mini-batch at once (verl's global-batch semantics).
Each objective, given the same mini-batch split over two data-parallel "ranks" and cut into random micro-batches
(groups split), must give their value and gradient after the trainer's one division by the summed count: for
every aggregation mode and clip setting. The "model" is a tensor of token log-probs ``theta [S, T]`` with grad.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from megatron_pacs.algo.advantages import outcome_advantages
from megatron_pacs.algo.objectives import Logprobs, MiniBatch, build_objective
from megatron_pacs.algo.policy_losses import AGG_MODES, aggregation_weights
from megatron_pacs.algo.token_objectives import overlong_penalty
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

N, S, T = 4, 16, 9  # group size, responses of the mini-batch, max response length

# --- verl's definitions, re-derived on [B, T] ----------------------------------------------------------------------


def verl_agg_loss(loss_mat, mask, mode, max_len):
    """verl ``agg_loss`` over the global mini-batch (token-mean over its tokens; seq-means over its non-empty
    sequences; seq-mean-token-sum-norm divides each token sum by the constant ``max_len``)."""
    mask = mask.to(loss_mat)
    seq_sum = (loss_mat * mask).sum(-1)
    nonempty = (mask.sum(-1) > 0).to(loss_mat)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / nonempty.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).sum() / nonempty.sum()
    return (seq_sum / max_len).sum() / nonempty.sum()


def verl_vanilla(old, logp, adv, mask, low, high, c, mode, max_len):
    """verl ``compute_policy_loss_vanilla``: asymmetric clip, dual clip at ``c`` for negative advantages."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * c
    losses = torch.where(adv < 0, torch.minimum(pg3, clip1), clip1)
    return verl_agg_loss(losses, mask, mode, max_len)


def verl_gspo(old, logp, adv, mask, low, high, mode, max_len):
    """verl ``compute_policy_loss_gspo``: sg[sequence geometric-mean ratio] * r_t / sg[r_t], clipped."""
    m = mask.to(logp)
    neg_kl_seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = (logp - logp.detach() + neg_kl_seq.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    losses = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - low, 1 + high))
    return verl_agg_loss(losses, mask, mode, max_len)


def verl_cispo(old, logp, adv, mask, low, high, mode, max_len):
    """CISPO (MiniMax-M1 eq. 4-5, verl ``compute_policy_loss_cispo``): -sg[clip(r)] * A * logp."""
    ratio = torch.exp((logp.detach() - old).clamp(-20.0, 20.0))
    losses = -torch.clamp(ratio, 1 - low, 1 + high).detach() * adv * logp
    return verl_agg_loss(losses, mask, mode, max_len)


# --- the objective under the loss contract --------------------------------------------------------------------------


def _tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    theta = (-torch.rand(S, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    lens = torch.randint(1, T + 1, (S,), generator=gen)
    lens[3] = lens[10] = T  # two responses reach the max length (truncated)
    mask = torch.arange(T)[None] < lens[:, None]
    rewards = torch.randint(0, 2, (S,), generator=gen).double()
    rewards[:N] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # at least one group with signal
    old = theta.detach() + 0.3 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    return theta, mask, lens, rewards, old


def _scored(theta, mask, rows, entropy=None) -> TokenLogprobs:
    idx = torch.tensor(rows, dtype=torch.long)
    m = mask[idx]
    lengths = m.sum(-1)
    seq = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    rank = torch.cat([torch.arange(int(n)) for n in lengths])
    ent = None if entropy is None else entropy[idx][m]
    return TokenLogprobs(logp=theta[idx][m], seq=seq, rank=rank, index=idx, lengths=lengths, entropy=ent)


def _contract_loss(loss_cfg: LossConfig, theta, mask, lens, rewards, old, gen, entropy=None):
    """The objective's loss over two DP ranks' halves of the mini-batch, each cut at random: sum / sum of counts."""
    objective = build_objective(loss_cfg, BatchConfig(group_size=N, max_response_length=T))
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    store = Logprobs(torch.zeros(S), tokens=TokenStore(old[mask].float(), offsets))
    total, count = torch.zeros((), dtype=torch.float64), 0
    for rank_rows in (list(range(S // 2)), list(range(S // 2, S))):  # whole groups per rank
        prepared = objective.prepare(
            MiniBatch(
                rows=torch.tensor(rank_rows),
                rewards=rewards.float(),
                response_lens=lens,
                group_size=N,
                fresh=False,
                old=store,
                batch_rows=torch.arange(S),
            )
        )
        cuts = sorted(torch.randperm(len(rank_rows) - 1, generator=gen)[:2].add(1).tolist())
        for a, b in itertools.pairwise([0, *cuts, len(rank_rows)]):
            loss_sum, cnt, _ = prepared.loss(_scored(theta, mask, rank_rows[a:b], entropy))
            total = total + loss_sum.double()
            count += int(cnt)
    return total / count


CLIPS = [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo"])
def test_objective_equals_verl_value_and_gradient_under_any_split(loss, clip, mode):
    low, high, c = clip
    theta, mask, lens, rewards, old = _tensors(seed=zlib.crc32(f"{loss}{clip}{mode}".encode()))
    old = old.float().double()  # the store keeps float32, as the trainer's
    adv = outcome_advantages(rewards, group_size=N)
    adv_bt = adv.double()[:, None].expand(S, T)
    extra = {"clip_ratio_c": c} if loss == "grpo" else {}
    cfg = LossConfig(loss=loss, loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high, **extra)
    if loss == "grpo":
        ref = verl_vanilla(old, theta, adv_bt, mask, low, high, c, mode, T)
    elif loss == "gspo":
        ref = verl_gspo(old, theta, adv_bt, mask, low, high, mode, T)
    else:
        ref = verl_cispo(old, theta, adv_bt, mask, low, high, mode, T)
    (ref_grad,) = torch.autograd.grad(ref, theta)
    assert ref_grad.abs().sum() > 0
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):  # three random micro-batch cuts
        got = _contract_loss(cfg, theta, mask, lens, rewards, old, gen)
        assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)  # float32 token losses that cancel
        (g,) = torch.autograd.grad(got, theta)
        torch.testing.assert_close(g, ref_grad, rtol=1e-4, atol=1e-6)


def test_the_clip_variants_change_the_loss_where_verl_says():
    """The clip settings matter (the comparison above is not vacuous): clip-higher lets positive-advantage ratios
    above 1.2 through, and a dual-clip bound of 1.5 caps negative-advantage losses that 3.0 does not."""
    theta, mask, _, rewards, old = _tensors(seed=3)
    adv_bt = outcome_advantages(rewards, group_size=N).double()[:, None].expand(S, T)
    base = verl_vanilla(old, theta, adv_bt, mask, 0.2, 0.2, 3.0, "token-mean", T)
    assert verl_vanilla(old, theta, adv_bt, mask, 0.2, 0.28, 3.0, "token-mean", T) != base
    assert verl_vanilla(old, theta, adv_bt, mask, 0.2, 0.2, 1.5, "token-mean", T) != base


def test_the_default_grpo_aggregation_is_the_released_one():
    """Default GRPO keeps ``seq-mean-token-sum-norm``: (1 / M) sum_i sum_t l_it / T_max, weights 1 / T_max."""
    assert LossConfig(loss="grpo").agg_mode == "seq-mean-token-sum-norm"
    w = aggregation_weights(torch.tensor([3, 5, 9]), mode="seq-mean-token-sum-norm", max_response_len=9)
    torch.testing.assert_close(w, torch.full((3,), 1 / 9, dtype=torch.float64))


# --- advantages and DAPO's shaping ----------------------------------------------------------------------------------


def verl_rloo(scores, n):
    s = scores.view(-1, n)
    return (s * n / (n - 1) - s.mean(-1, keepdim=True) * n / (n - 1)).reshape(-1)


def verl_opo(scores, lens, n):
    s, ln = scores.view(-1, n), lens.double().view(-1, n)
    return (s - (ln * s).sum(-1, keepdim=True) / ln.sum(-1, keepdim=True)).reshape(-1)


def verl_rpp_baseline(scores, mask, n):
    """verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``: group-centred, then ``masked_whiten`` over
    the batch's tokens (unbiased variance)."""
    s = scores.view(-1, n)
    centred = (s - s.mean(-1, keepdim=True)).reshape(-1)
    x = centred[:, None].expand_as(mask).double()
    m = mask.double()
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    return ((x - mean) * torch.rsqrt(var + 1e-8))[:, 0]


def test_advantage_estimators_equal_verls():
    _, mask, lens, rewards, _ = _tensors(seed=5)
    rewards = rewards + 0.1 * torch.arange(S).double()  # distinct rewards: no degenerate group
    torch.testing.assert_close(
        outcome_advantages(rewards, group_size=N, estimator="rloo").double(),
        verl_rloo(rewards, N),
        rtol=1e-6,
        atol=1e-6,
    )
    torch.testing.assert_close(
        outcome_advantages(rewards, group_size=N, estimator="opo", response_lens=lens).double(),
        verl_opo(rewards, lens, N),
        rtol=1e-6,
        atol=1e-6,
    )
    torch.testing.assert_close(
        outcome_advantages(
            rewards, group_size=N, estimator="reinforce_plus_plus_baseline", response_lens=lens
        ).double(),
        verl_rpp_baseline(rewards, mask, N),
        rtol=1e-5,
        atol=1e-6,
    )
    g = rewards.view(-1, N)
    dr_grpo = (g - g.mean(-1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(
        outcome_advantages(rewards, group_size=N, norm_by_std=False).double(), dr_grpo, rtol=1e-6, atol=1e-6
    )
    std = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(
        outcome_advantages(rewards, group_size=N).double(), std.reshape(-1), rtol=1e-5, atol=1e-6
    )


def test_overlong_penalty_is_dapos_linear_buffer():
    """verl's DAPO reward manager: ``min(-(L - (T_max - buffer)) / buffer * factor, 0)``."""
    lens = torch.tensor([10, 12, 13, 16, 20])
    got = overlong_penalty(lens, max_response_len=20, buffer_len=8, factor=0.5)
    want = [min(-(n - 12) / 8 * 0.5, 0.0) for n in lens.tolist()]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def test_shaping_and_masking_enter_the_objective_as_verl_with_the_truncated_masked_out():
    """--overlong-buffer-len shapes the rewards the advantages see; --mask-truncated gives the truncated responses
    no loss and no place in the normaliser (verl's agg_loss with their mask zeroed), under any split."""
    theta, mask, lens, rewards, old = _tensors(seed=11)
    old = old.float().double()
    shaped = rewards + overlong_penalty(lens, max_response_len=T, buffer_len=4, factor=1.0)
    adv_bt = outcome_advantages(shaped, group_size=N, estimator="rloo").double()[:, None].expand(S, T)
    kept = mask & (lens < T)[:, None]
    for mode in AGG_MODES:
        ref = verl_vanilla(old, theta, adv_bt, kept, 0.2, 0.28, 3.0, mode, T)
        (ref_grad,) = torch.autograd.grad(ref, theta)
        cfg = LossConfig(
            loss="grpo",
            loss_agg_mode=mode,
            clip_ratio_high=0.28,
            advantage_estimator="rloo",
            overlong_buffer_len=4,
            mask_truncated=True,
        )
        got = _contract_loss(cfg, theta, mask, lens, rewards, old, torch.Generator().manual_seed(1))
        assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)  # float32 token losses that cancel
        (g,) = torch.autograd.grad(got, theta)
        torch.testing.assert_close(g, ref_grad, rtol=1e-4, atol=1e-6)
        assert g[3].abs().sum() == 0 and g[10].abs().sum() == 0  # the truncated responses


@pytest.mark.parametrize("mode", AGG_MODES)
def test_entropy_bonus_is_verls_under_any_split(mode):
    """--entropy-coef: verl's ``pg_loss - entropy_coeff * agg_loss(entropy, mask, loss_agg_mode)``, value and
    gradient through the entropies, under any split; the objective asks the pass for the entropy's gradient."""
    theta, mask, lens, rewards, old = _tensors(seed=21)
    old = old.float().double()
    entropy = torch.rand(S, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    adv_bt = outcome_advantages(rewards, group_size=N).double()[:, None].expand(S, T)
    coef = 0.01
    ref = verl_cispo(old, theta, adv_bt, mask, 0.2, 4.0, mode, T) - coef * verl_agg_loss(entropy, mask, mode, T)
    ref_grads = torch.autograd.grad(ref, (theta, entropy))
    cfg = LossConfig(loss="cispo", loss_agg_mode=mode, clip_ratio_high=4.0, entropy_coef=coef)
    objective = build_objective(cfg, BatchConfig(group_size=N, max_response_length=T))
    assert objective.entropy_grad and objective.loss_keys == ("cispo/loss", "actor/entropy_loss")
    assert not build_objective(LossConfig(loss="cispo"), BatchConfig()).entropy_grad
    got = _contract_loss(cfg, theta, mask, lens, rewards, old, torch.Generator().manual_seed(3), entropy)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    for g, r in zip(torch.autograd.grad(got, (theta, entropy)), ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_term_takes_the_objectives_aggregation_as_verls_kl_loss(mode):
    """--kl-coef with a token-level objective: verl's ``kl_loss_coef * agg_loss(kld, mask, loss_agg_mode)`` (k3,
    ``low_var_kl``, clamped to +-10), added to the policy loss, under any split."""
    theta, mask, lens, rewards, old = _tensors(seed=31)
    old = old.float().double()
    ref_logp = (theta.detach() + 0.2 * torch.randn(S, T, generator=torch.Generator().manual_seed(4))).float().double()
    adv_bt = outcome_advantages(rewards, group_size=N).double()[:, None].expand(S, T)
    kl = torch.exp(ref_logp - theta) - (ref_logp - theta) - 1
    want = verl_vanilla(old, theta, adv_bt, mask, 0.2, 0.28, 3.0, mode, T) + 0.1 * verl_agg_loss(
        kl.clamp(-10, 10), mask, mode, T
    )
    (want_grad,) = torch.autograd.grad(want, theta)
    cfg = LossConfig(loss="grpo", loss_agg_mode=mode, clip_ratio_high=0.28, kl_coef=0.1, kl_estimator="k3")
    objective = build_objective(cfg, BatchConfig(group_size=N, max_response_length=T))
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    store = Logprobs(torch.zeros(S), tokens=TokenStore(old[mask].float(), offsets))
    ref = Logprobs(torch.zeros(S), tokens=TokenStore(ref_logp[mask].float(), offsets))
    total, count = torch.zeros((), dtype=torch.float64), 0
    for rank_rows in (list(range(S // 2)), list(range(S // 2, S))):
        mb = MiniBatch(
            rows=torch.tensor(rank_rows),
            rewards=rewards.float(),
            response_lens=lens,
            group_size=N,
            fresh=False,
            old=store,
            ref=ref,
            batch_rows=torch.arange(S),
        )
        prepared = objective.prepare(mb)
        for a, b in itertools.pairwise([0, 3, len(rank_rows)]):
            loss_sum, cnt, _ = prepared.loss(_scored(theta, mask, rank_rows[a:b]))
            total, count = total + loss_sum.double(), count + int(cnt)
    got = total / count
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    (g,) = torch.autograd.grad(got, theta)
    torch.testing.assert_close(g, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("loss", "level"), [("grpo", "token"), ("gspo", "geometric"), ("cispo", "token")])
def test_off_policy_weights_multiply_the_token_losses_as_verls_rollout_is_weights(loss, level):
    """--off-policy-correction tis: verl multiplies ``pg_losses`` by ``rollout_is_weights`` before ``agg_loss``;
    token ratios per token, GSPO's default geometric ratio once per response (on each of its tokens)."""
    theta, mask, lens, rewards, old = _tensors(seed=41)
    old = old.float().double()
    gen = torch.Generator().manual_seed(5)
    is_tokens = (0.5 + torch.rand(S, T, generator=gen, dtype=torch.float64)).float().double()
    is_seq = (0.5 + torch.rand(S, generator=gen, dtype=torch.float64)).float().double()
    w_bt = is_tokens if level == "token" else is_seq[:, None].expand(S, T)
    adv_bt = outcome_advantages(rewards, group_size=N).double()[:, None].expand(S, T)
    mode = "token-mean"
    if loss == "grpo":
        ratio = torch.exp((theta - old).clamp(-20.0, 20.0))
        l1 = torch.maximum(-adv_bt * ratio, -adv_bt * ratio.clamp(0.8, 1.2))
        losses = torch.where(adv_bt < 0, torch.minimum(l1, -adv_bt * 3.0), l1)
    elif loss == "gspo":
        m = mask.double()
        seq = ((theta - old) * m).sum(-1) / m.sum(-1)
        s = torch.exp((theta - theta.detach() + seq.detach()[:, None]).clamp(max=10.0))
        losses = torch.maximum(-adv_bt * s, -adv_bt * s.clamp(0.8, 1.2))
    else:
        ratio = torch.exp((theta.detach() - old).clamp(-20.0, 20.0))
        losses = -ratio.clamp(0.8, 1.2) * adv_bt * theta
    want = verl_agg_loss(losses * w_bt, mask, mode, T)
    (want_grad,) = torch.autograd.grad(want, theta)
    cfg = LossConfig(loss=loss, loss_agg_mode=mode, off_policy_correction="tis", tis_level=level)
    objective = build_objective(cfg, BatchConfig(group_size=N, max_response_length=T))
    assert objective.correction == level
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    store = Logprobs(torch.zeros(S), tokens=TokenStore(old[mask].float(), offsets))
    if level == "token":
        importance = Logprobs(torch.ones(S, dtype=torch.float64), TokenStore(is_tokens[mask].float(), offsets))
    else:
        importance = Logprobs(is_seq)
    prepared = objective.prepare(
        MiniBatch(
            rows=torch.arange(S),
            rewards=rewards.float(),
            response_lens=lens,
            group_size=N,
            fresh=False,
            old=store,
            importance=importance,
        )
    )
    total, count = torch.zeros((), dtype=torch.float64), 0
    for a, b in itertools.pairwise([0, 5, 11, S]):
        loss_sum, cnt, _ = prepared.loss(_scored(theta, mask, list(range(a, b))))
        total, count = total + loss_sum.double(), count + int(cnt)
    got = total / count
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    (g,) = torch.autograd.grad(got, theta)
    torch.testing.assert_close(g, want_grad, rtol=1e-4, atol=1e-6)
