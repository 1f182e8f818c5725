"""megatron_pacs.algo.objectives: needs, registry, and the loss contract under any micro-batch split.

The "model" here is a tensor of token log-probs ``theta [S, T]`` with grad: each objective's micro-batch losses,
each given its micro-batch's scored tokens flattened (``TokenLogprobs``, as every layout produces them), summed over
a split of the mini-batch (groups split) and divided once by the summed count, must give the value and gradient of
the whole-batch loss computed directly with autograd.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_pacs.algo.grpo import grpo_advantages, grpo_loss
from megatron_pacs.algo.objectives import (
    OBJECTIVES,
    Logprobs,
    MiniBatch,
    PacsDirect,
    PacsTwoPhase,
    build_objective,
)
from megatron_pacs.algo.pacs import pacs_loss
from megatron_pacs.algo.token_objectives import GrpoObjective
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

N, S, T = 4, 16, 7  # group size, responses of the step, token positions per row


def _step_tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    theta = (-torch.rand(S, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    lens = torch.randint(1, T + 1, (S,), generator=gen)
    mask = torch.arange(T)[None] < lens[:, None]
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float64)
    old_tokens = theta.detach() + 0.1 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    old_seq = torch.where(mask, old_tokens, 0.0).sum(-1)
    return theta, mask, lens, rewards, old_seq, old_tokens


def _scored(theta, mask, rows) -> TokenLogprobs:
    """The scored tokens of a micro-batch holding ``rows``: ``theta``'s masked entries, row after row."""
    idx = torch.tensor(rows, dtype=torch.long)
    m = mask[idx]
    lengths = m.sum(-1)
    seq = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    rank = torch.cat([torch.arange(int(n)) for n in lengths])
    return TokenLogprobs(logp=theta[idx][m], seq=seq, rank=rank, index=idx, lengths=lengths)


def _split_losses(prepared, theta, mask, rows, cuts):
    """Sum of the micro-batch losses over ``rows`` cut at ``cuts``."""
    total, count = 0.0, 0
    bounds = [0, *cuts, len(rows)]
    for a, b in itertools.pairwise(bounds):
        loss_sum, cnt, _ = prepared.loss(_scored(theta, mask, rows[a:b]))
        total = total + loss_sum.double()
        count += int(cnt)
    return total, count


def _config(**loss):
    return LossConfig(**loss), BatchConfig(global_batch_size=4, group_size=N, ppo_mini_batch_size=4)


@pytest.mark.parametrize("advantage", ["rloo", "grpo", "grpo_no_std", "naive"])
@pytest.mark.parametrize("score", ["log_ratio", "mean_logp"])
def test_two_phase_and_direct_equal_the_whole_batch_gradient_under_any_split(advantage, score):
    theta, mask, lens, rewards, old_seq, _ = _step_tensors()
    cfg = LossConfig(pacs_advantage=advantage, pacs_score=score, pacs_beta=0.7)
    rows = list(range(S))
    seq = torch.where(mask, theta, 0.0).sum(-1)
    ref = pacs_loss(
        seq,
        old_seq,
        rewards,
        group_size=N,
        beta=0.7,
        score=score,
        advantage=advantage,
        weights="balanced",
        response_lens=lens,
    )
    (ref_grad,) = torch.autograd.grad(ref.loss_sum / ref.count, theta)

    two_phase = PacsTwoPhase(cfg)
    mb = MiniBatch(
        rows=torch.tensor(rows),
        rewards=rewards.float(),
        response_lens=lens,
        group_size=N,
        fresh=False,
        old=Logprobs(old_seq),
        current=seq.detach(),
    )
    prepared = two_phase.prepare(mb)
    for cuts in ([], [3], [5, 6, 11], list(range(1, S))):  # 3 and 5 split groups of 4
        total, count = _split_losses(prepared, theta, mask, rows, cuts)
        assert count == S
        (g,) = torch.autograd.grad(total / count, theta)
        torch.testing.assert_close(g, ref_grad, rtol=1e-5, atol=1e-7)
    assert prepared.metrics["pacs/loss"][0].item() == pytest.approx(ref.loss_sum.item(), rel=1e-5)

    direct = PacsDirect(cfg).prepare(mb)
    for cuts in ([], [4], [4, 8, 12]):  # group boundaries only
        total, count = _split_losses(direct, theta, mask, rows, cuts)
        assert (total / count).item() == pytest.approx((ref.loss_sum / ref.count).item(), rel=1e-6)
        (g,) = torch.autograd.grad(total / count, theta)
        # the loss is returned in float32 (Megatron's accumulation); the grpo estimator divides by the group std
        torch.testing.assert_close(g, ref_grad, rtol=1e-4, atol=1e-6)


def test_fresh_two_phase_needs_no_forward_and_matches_theta_equal_theta_old():
    theta, mask, lens, rewards, _, _ = _step_tensors(1)
    obj = PacsTwoPhase(LossConfig())
    assert not obj.needs_current(fresh=True) and obj.needs_current(fresh=False)
    assert obj.old_logprobs == "sequence" and not obj.whole_groups
    seq = torch.where(mask, theta, 0.0).sum(-1)
    ref = pacs_loss(seq, seq.detach(), rewards, group_size=N)  # l_old = l exactly
    (ref_grad,) = torch.autograd.grad(ref.loss_sum / ref.count, theta)
    rows = list(range(S))
    prepared = obj.prepare(
        MiniBatch(rows=torch.tensor(rows), rewards=rewards.float(), response_lens=lens, group_size=N, fresh=True)
    )
    total, count = _split_losses(prepared, theta, mask, rows, [3, 9])
    (g,) = torch.autograd.grad(total / count, theta)
    torch.testing.assert_close(g, ref_grad, rtol=1e-5, atol=1e-7)
    mean_logp = PacsTwoPhase(LossConfig(pacs_score="mean_logp"))
    assert mean_logp.needs_current(fresh=True) and mean_logp.old_logprobs is None


def test_grpo_objective_is_split_invariant_and_uses_the_old_token_logprobs():
    theta, mask, lens, rewards, _, old_tokens = _step_tensors(2)
    obj = GrpoObjective(LossConfig(clip_ratio=0.2), max_response_length=T)
    assert obj.old_logprobs == "token" and not obj.needs_current(fresh=False)
    rows = list(range(S))
    adv = grpo_advantages(rewards.float(), group_size=N)
    ref = grpo_loss(theta, old_tokens, mask, adv, max_response_len=T, clip_ratio=0.2)
    (ref_grad,) = torch.autograd.grad(ref.loss_sum / ref.count, theta)
    offsets = torch.zeros(S + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    old = Logprobs(torch.zeros(S), tokens=TokenStore(old_tokens[mask], offsets))
    prepared = obj.prepare(
        MiniBatch(
            rows=torch.tensor(rows), rewards=rewards.float(), response_lens=lens, group_size=N, fresh=False, old=old
        )
    )
    for cuts in ([], [1, 7], [5]):
        total, count = _split_losses(prepared, theta, mask, rows, cuts)
        assert (total / count).item() == pytest.approx((ref.loss_sum / ref.count).item(), rel=1e-6)
        (g,) = torch.autograd.grad(total / count, theta)
        torch.testing.assert_close(g, ref_grad, rtol=1e-5, atol=1e-7)


def test_registry_builds_the_configured_objective_and_names_the_choices():
    assert isinstance(build_objective(*_config()), PacsTwoPhase)
    loss, batch = LossConfig(), BatchConfig(group_size=N, micro_batch_size=8, keep_groups_in_microbatch=True)
    direct = build_objective(loss, batch)
    assert isinstance(direct, PacsDirect) and direct.whole_groups
    assert isinstance(build_objective(*_config(loss="grpo")), GrpoObjective)
    assert OBJECTIVES.names() == ["cispo", "grpo", "gspo", "pacs", "ppo"]
    with pytest.raises(
        ValueError, match=r"loss='a2c' is not a valid option; choose one of \['cispo', 'grpo', 'gspo', 'pacs', 'ppo'\]"
    ):
        OBJECTIVES.get("a2c")
    assert build_objective(*_config()).loss_key == "pacs/loss"
    assert build_objective(*_config(loss="grpo")).loss_key == "grpo/loss"


def test_tis_level_defaults_to_bounded_bias_per_loss_and_keeps_the_product_selectable():
    """PACS's default ratio is the per-token geometric mean (its numerics bias does not grow with the length);
    GRPO's is per token; the exact sequence product stays selectable (docs/algorithm.md §5.1)."""
    tis = {"off_policy_correction": "tis"}
    assert build_objective(LossConfig(**tis), BatchConfig()).correction == "geometric"
    assert build_objective(LossConfig(**tis, tis_level="sequence"), BatchConfig()).correction == "sequence"
    assert build_objective(LossConfig(loss="grpo", **tis), BatchConfig()).correction == "token"
    assert build_objective(LossConfig(), BatchConfig()).correction is None
