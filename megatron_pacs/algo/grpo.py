"""The GRPO baseline loss (docs/algorithm.md §6): group-normalised outcome advantage, PPO clipped surrogate.

    adv_i  = (R_i - mean_g R) / (std_g R + 1e-6)            # per group, std unbiased; no std: R_i - mean_g R
    ratio  = exp(logp - logp_old)                           # per token
    l_t    = max(-adv * ratio, -adv * clip(ratio, 1 - eps_low, 1 + eps_high))   (dual clip at c for adv < 0)
    L      = (1 / S) * sum_i sum_t mask_it * l_it / T_max  # "seq-mean-token-sum-norm" (Dr. GRPO)

T_max is a constant (the configured maximum response length), so the value does not depend on the padding of a
micro-batch. verl before February 2026 divided each micro-batch's token sum by its padded width and averaged
micro-batches (our L times a constant factor that Adam normalises away); current verl with ``loss_scale_factor =
T_max`` computes L itself (docs/algorithm.md §6). Advantages depend only on rewards, so they are computed once per
batch (:func:`grpo_advantages`) and the token loss can then be split across micro-batches freely.

Shapes: S responses (groups contiguous), T response tokens (padded).
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.checks import as_float_vector, check_1d, check_finite, check_groups, check_rewards
from megatron_pacs.algo.loss_contract import LossOutput, mean_entry, stat_entries
from megatron_pacs.algo.policy_losses import ClipRange, ppo_clip_losses

__all__ = ["grpo_advantages", "grpo_loss", "grpo_token_loss"]

GRPO_ADV_EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, *, group_size: int, norm_by_std: bool = True) -> torch.Tensor:
    """Group-normalised outcome advantages.

    Args:
        rewards: ``[S]`` rewards, groups of ``group_size`` contiguous.
        group_size: N >= 2.
        norm_by_std: Divide by the group's unbiased std (+1e-6); False gives Dr. GRPO's mean-centring only.

    Returns:
        ``[S]`` float32 advantages (no grad).
    """
    rewards = torch.as_tensor(rewards).float()
    check_1d("rewards", rewards)
    check_finite("rewards", rewards)
    check_groups(rewards.shape[0], group_size, need_pairs=True)
    r = rewards.view(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if norm_by_std:
        adv = adv / (r.std(-1, keepdim=True) + GRPO_ADV_EPS)
    return adv.reshape(-1)


def grpo_token_loss(
    token_logp: torch.Tensor,
    token_old_logp: torch.Tensor,
    token_advantages: torch.Tensor,
    *,
    num_responses: int,
    max_response_len: int,
    clip_ratio: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rewards: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    token_scale: torch.Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate with GRPO advantages over flat response tokens, as a global sum over responses.

    The hot path of the trainer: no checks that need a device sync (:func:`grpo_loss` validates its inputs).

    Args:
        token_logp: ``[N]`` current-policy log-probs of the response tokens of ``num_responses`` responses, with
            grad.
        token_old_logp: ``[N]`` rollout-policy log-probs of the same tokens.
        token_advantages: ``[N]`` each token's response advantage (from :func:`grpo_advantages`).
        num_responses: S, the responses these tokens belong to (the loss's ``count``).
        max_response_len: T_max, the constant token-sum normaliser (the configured max response length).
        clip_ratio: PPO epsilon (verl default 0.2).
        clip_ratio_c: Dual-clip bound for negative advantages (verl default 3.0); None disables it.
        rewards: Optional ``[S]`` rewards in [0, 1], only for the reward metric.
        token_weights: ``[N]`` multipliers of the token losses (truncated importance ratios of off-policy
            rollouts, docs/algorithm.md §5.1), or None.
        clip_ratio_low: The lower clip, ``ratio >= 1 - clip_ratio_low`` (DAPO's clip-higher); None: ``clip_ratio``.
        clip_ratio_high: The upper clip, ``ratio <= 1 + clip_ratio_high``; None: ``clip_ratio``.
        token_scale: ``[N]`` each token's aggregation weight (``--loss-agg-mode``,
            :func:`~megatron_pacs.algo.policy_losses.aggregation_weights`) in place of ``1 / max_response_len``.

    Returns:
        ``LossOutput(loss_sum, count=S, metrics)``; ``loss_sum / count`` is L in the module docstring.
    """
    if max_response_len <= 0:
        raise ValueError(f"max_response_len={max_response_len} must be > 0 (the configured max response tokens)")
    if not 0 < clip_ratio < 1:
        raise ValueError(f"clip_ratio={clip_ratio} must lie in (0, 1); PPO's usual value is 0.2")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual clip) or None to disable it")
    clip = ClipRange(
        low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        c=clip_ratio_c,
    )
    log_ratio = (token_logp.float() - token_old_logp.float()).clamp(-20.0, 20.0)
    tok_loss, clipped, lower_clipped = ppo_clip_losses(log_ratio, token_advantages.float(), clip)
    if token_weights is not None:
        tok_loss = tok_loss * token_weights.to(tok_loss)
    if token_scale is None:
        loss_sum = tok_loss.sum() / max_response_len
    else:
        loss_sum = (tok_loss * token_scale.to(tok_loss)).sum()

    with torch.no_grad():
        n_tok = token_logp.numel()
        m = {
            "grpo/loss": torch.stack([loss_sum.detach(), loss_sum.new_tensor(float(num_responses))]),
            "grpo/clip_frac": mean_entry(clipped.sum().float(), n_tok, tok_loss),
            "grpo/clip_frac_lower": mean_entry(lower_clipped.sum().float(), n_tok, tok_loss),
            "grpo/approx_kl": mean_entry((-log_ratio).sum(), n_tok, tok_loss),
        }
        if rewards is not None:
            m["grpo/reward_mean"] = mean_entry(rewards.detach().float().sum(), num_responses, tok_loss)
    return LossOutput(loss_sum=loss_sum, count=num_responses, metrics=m)


def grpo_loss(
    token_logp: torch.Tensor,
    token_old_logp: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    max_response_len: int,
    clip_ratio: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rewards: torch.Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate with GRPO advantages on padded ``[S, T]`` tokens (validated; see
    :func:`grpo_token_loss`, which it calls on the masked tokens).

    Args:
        token_logp: ``[S, T]`` current-policy token log-probs, with grad.
        token_old_logp: ``[S, T]`` rollout-policy token log-probs.
        response_mask: ``[S, T]`` 1 for response tokens.
        advantages: ``[S]`` from :func:`grpo_advantages` (computed over whole groups).
        max_response_len: T_max, the constant token-sum normaliser (the configured max response length).
        clip_ratio: PPO epsilon (verl default 0.2).
        clip_ratio_c: Dual-clip bound for negative advantages (verl default 3.0); None disables it.
        rewards: Optional ``[S]`` rewards in [0, 1], only for the reward metric.

    Returns:
        ``LossOutput(loss_sum, count=S, metrics)``; ``loss_sum / count`` is L above.
    """
    if token_logp.shape != token_old_logp.shape or token_logp.shape != response_mask.shape:
        raise ValueError(
            f"token_logp {tuple(token_logp.shape)}, token_old_logp {tuple(token_old_logp.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must share one [S, T] shape"
        )
    num = token_logp.shape[0]
    adv = as_float_vector("advantages", advantages, token_logp)
    check_finite("advantages", adv)
    mask = response_mask.bool()
    check_finite("token_old_logp", torch.where(mask, token_old_logp, 0))
    check_finite("token_logp", torch.where(mask, token_logp.detach(), 0))
    if rewards is not None:
        rewards = as_float_vector("rewards", rewards, token_logp)
        check_rewards(rewards)
    out = grpo_token_loss(
        token_logp[mask],
        token_old_logp[mask],
        adv[:, None].expand_as(token_logp)[mask],
        num_responses=num,
        max_response_len=max_response_len,
        clip_ratio=clip_ratio,
        clip_ratio_c=clip_ratio_c,
        rewards=rewards,
    )
    out.metrics.update(stat_entries("grpo/advantage", adv))
    return out
