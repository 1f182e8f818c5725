"""--tis-mode: truncate keeps min(ratio, --tis-high) bit for bit at the default --tis-low 0; mask gives 0 weight (no
gradient of its own) to a token (GRPO) or response (PACS) whose ratio leaves [--tis-low, --tis-high], while the loss's
normaliser still counts it."""

import pytest
import torch
import torch.nn.functional as F

from megatron_pacs.algo.grpo import grpo_token_loss
from megatron_pacs.algo.importance import bound_ratios
from megatron_pacs.algo.pacs import compute_scores, group_advantages, group_weights, pacs_loss

RATIOS = torch.tensor([0.2, 0.5, 1.0, 1.9, 2.0, 2.5, 7.0], dtype=torch.float64)


def test_truncate_at_the_default_lower_bound_is_the_old_min_exactly():
    weights, truncated = bound_ratios(RATIOS, mode="truncate", high=2.0)
    assert torch.equal(weights, RATIOS.clamp(max=2.0))
    assert truncated.tolist() == (RATIOS > 2.0).tolist()


def test_truncate_clips_into_both_bounds_and_mask_zeroes_outside_them():
    weights, truncated = bound_ratios(RATIOS, mode="truncate", low=0.5, high=2.0)
    assert weights.tolist() == [0.5, 0.5, 1.0, 1.9, 2.0, 2.0, 2.0]
    assert truncated.tolist() == [True, False, False, False, False, True, True]
    weights, masked = bound_ratios(RATIOS, mode="mask", low=0.5, high=2.0)
    assert weights.tolist() == [0.0, 0.5, 1.0, 1.9, 2.0, 0.0, 0.0]  # the bounds themselves are kept
    assert masked.tolist() == [True, False, False, False, False, True, True]
    nan, masked = bound_ratios(torch.tensor([float("nan")]), mode="mask", high=2.0)
    assert nan.tolist() == [0.0] and masked.tolist() == [True]
    with pytest.raises(ValueError, match="--tis-mode"):
        bound_ratios(RATIOS, mode="clip", high=2.0)
    with pytest.raises(ValueError, match="--tis-low"):
        bound_ratios(RATIOS, mode="mask", low=1.0, high=2.0)


def test_token_level_mask_leaves_masked_tokens_without_gradient_and_the_normaliser_unchanged():
    """GRPO: a masked token's loss and gradient are 0; the others' are their ratio-weighted ones; the normaliser
    (responses x --max-response-length) is the same as without masking."""
    torch.manual_seed(0)
    logp = (torch.randn(6, dtype=torch.float64) - 1).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(6, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    raw = torch.tensor([1.0, 3.0, 0.9, 0.1, 1.2, 1.0], dtype=torch.float64)  # token 1 above, token 3 below
    weights, masked = bound_ratios(raw, mode="mask", low=0.5, high=2.0)
    out = grpo_token_loss(logp, old, adv, num_responses=2, max_response_len=4, token_weights=weights)
    out.loss.backward()
    assert logp.grad is not None
    assert masked.tolist() == [False, True, False, True, False, False]
    assert logp.grad[masked].tolist() == [0.0, 0.0] and (logp.grad[~masked] != 0).all()
    assert out.count == 2
    # the kept tokens' gradients equal those of the unweighted loss scaled by their ratio
    logp2 = logp.detach().clone().requires_grad_()
    grpo_token_loss(logp2, old, adv, num_responses=2, max_response_len=4).loss.backward()
    assert logp2.grad is not None
    assert torch.allclose(logp.grad[~masked], logp2.grad[~masked] * raw[~masked])


def test_response_level_mask_drops_the_response_s_own_term_of_the_pacs_loss():
    """PACS: a masked response's BCE term weighs 0 and the count stays S; its score still enters its group-mates'
    RLOO logits (docs/algorithm.md §5.1)."""
    torch.manual_seed(1)
    seq = (torch.randn(8, dtype=torch.float64) * 3 - 20).requires_grad_()
    old = seq.detach() + 0.2 * torch.randn(8, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    raw = torch.tensor([1.0, 5.0, 0.8, 1.1, 0.3, 1.0, 1.0, 1.9], dtype=torch.float64)  # responses 1 and 4 masked
    weights, masked = bound_ratios(raw, mode="mask", low=0.5, high=2.0)
    out = pacs_loss(seq, old, rewards, group_size=4, sample_weights=weights)
    assert masked.tolist() == [False, True, False, False, True, False, False, False]
    assert out.count == 8
    adv = group_advantages(compute_scores(seq.detach(), old, beta=1.0), group_size=4)
    w = group_weights(rewards, group_size=4) * raw
    terms = F.binary_cross_entropy_with_logits(adv, rewards, weight=w, reduction="none")
    assert float(out.loss_sum.detach()) == pytest.approx(float(terms[~masked].sum()), rel=1e-12)
    # its own term gone, a masked response still moves through its group-mates' RLOO baselines; with a logit of
    # its own score alone (naive) it gets no gradient at all
    out.loss.backward()
    assert seq.grad is not None and (seq.grad[masked] != 0).all()
    seq2 = seq.detach().clone().requires_grad_()
    pacs_loss(seq2, old, rewards, group_size=4, advantage="naive", sample_weights=weights).loss.backward()
    assert seq2.grad is not None and seq2.grad[masked].tolist() == [0.0, 0.0] and (seq2.grad[~masked] != 0).all()
