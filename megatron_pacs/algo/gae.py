"""PPO's critic maths (docs/algorithm.md §6.5): generalised advantage estimation and the clipped value loss.

    delta_t = r_t + gamma * V_{t+1} - V_t                  # V_{T} = 0 past the response's last token
    A_t     = delta_t + gamma * lam * A_{t+1}               # GAE (Schulman et al. 2016, eq. 16), backwards
    R_t     = A_t + V_t                                      # the critic's target (before whitening)
    A_t    <- (A_t - mean A) / sqrt(var A + 1e-8)            # whitened over the step's response tokens
    l_t     = 0.5 * max((v_t - R_t)^2, (clip(v_t, V_t - c, V_t + c) - R_t)^2)     # clipped value loss per token

These are verl's ``compute_gae_advantage_return``, ``masked_whiten`` and ``compute_value_loss``
(``trainer/ppo/core_algos.py``, re-derived; tests/algo/test_gae.py re-derives them again and compares). Positions
outside the mask are skipped as verl's masked recursion skips them (the next value and the running advantage carry
over them), and whatever they hold (NaN included) never reaches a result: this module selects with ``where``, not
with products, so NaN garbage cannot leak. Whitening needs the step's mean and variance over every response, which
the data-parallel ranks hold a share of each: :func:`gae_advantages` takes an optional ``reduce`` that sums a small
float64 tensor over the ranks (the caller's all-reduce), so the function itself stays free of torch.distributed.

Shapes: B responses (rows), T response tokens (padded, right or with holes), ``mask`` ``[B, T]`` True at tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["WHITEN_EPS", "clipped_value_loss", "explained_variance", "gae_advantages", "gae_returns", "masked_whiten"]

WHITEN_EPS = 1e-8
"""verl's ``masked_whiten`` epsilon under the square root."""

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor over the ranks that share the step's responses (identity on one rank)."""


def _check(mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask {tuple(mask.shape)} must be [B, T]")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name} {tuple(t.shape)} and mask {tuple(mask.shape)} must share one [B, T] shape")
    return mask.bool()


@torch.no_grad()
def gae_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages before whitening, and the returns ``A + V`` (the module docstring's first three lines).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (an outcome reward sits at a response's last token; a per-token
            KL penalty, when used, everywhere).
        values: ``[B, T]`` V(s_t), the critic's value before response token t.
        mask: ``[B, T]`` True at response tokens.
        gamma: Discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, ``[B, T]`` float32 each, 0 outside ``mask``.
    """
    m = _check(mask, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must lie in [0, 1]")
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    r = torch.where(m, token_rewards.float(), zero)
    v = torch.where(m, values.float(), zero)
    num_tokens = m.shape[1]
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    running = torch.zeros_like(v[:, 0])
    for t in reversed(range(num_tokens)):
        here = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, v[:, t], next_value)
        adv[:, t] = running
    adv = torch.where(m, adv, zero)
    return adv, torch.where(m, adv + v, zero)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, eps: float = WHITEN_EPS, reduce: Reduce | None = None
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries, the variance unbiased (verl's ``masked_whiten``
    with ``masked_var(unbiased=True)``); 0 outside ``mask``.

    Args:
        x: ``[B, T]`` values.
        mask: ``[B, T]`` True where ``x`` counts.
        eps: Added to the variance.
        reduce: Sums a float64 tensor over the ranks holding the rest of the entries (two calls: count and sum,
            then the squared deviations), or None for these entries alone.

    Returns:
        ``[B, T]`` float32.
    """
    m = _check(mask, x=x)
    total = reduce or (lambda t: t)
    xd = torch.where(m, x.double(), 0.0)
    count, s = total(torch.stack([m.sum().double(), xd.sum()])).unbind()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 masked entries over the step; got {int(count)}")
    mean = s / count
    dev = torch.where(m, xd - mean, 0.0)
    var = total(dev.pow(2).sum().reshape(1))[0] / (count - 1)
    return torch.where(m, dev * torch.rsqrt(var + eps), 0.0).float()


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened GAE advantages and the returns, as verl's ``compute_gae_advantage_return``.

    Args:
        token_rewards: ``[B, T]`` per-token rewards; ignored outside ``mask``, whatever they hold.
        values: ``[B, T]`` V(s_t) (the critic's value read at the position before token t); ignored outside ``mask``.
        mask: ``[B, T]`` True at response tokens.
        gamma: ``--gae-gamma`` in [0, 1].
        lam: ``--gae-lambda`` in [0, 1].
        reduce: With data parallelism, sums a float64 tensor over the ranks holding the step's other responses, so
            the whitening's mean and variance are the step's (see :func:`masked_whiten`); None: these rows alone.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` float32, 0 outside ``mask``: the advantages whitened, the returns
        the advantages *before* whitening plus the values.
    """
    adv, returns = gae_returns(token_rewards, values, mask, gamma=gamma, lam=lam)
    return masked_whiten(adv, mask, reduce=reduce), returns


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: ``0.5 * max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)``.

    Args:
        values: ``[B, T]`` the critic's current predictions v (with grad).
        old_values: ``[B, T]`` V_old, the predictions the returns were built from (no grad).
        returns: ``[B, T]`` the targets R (from :func:`gae_advantages`).
        mask: ``[B, T]`` True at response tokens; elsewhere the loss is 0 and nothing is clipped, whatever the
            inputs hold.
        clip: ``--value-clip`` c > 0.

    Returns:
        ``(per_token_loss [B, T], clipped [B, T] bool)``: ``clipped`` marks the tokens whose clipped term is the
        larger one (verl's ``vf_clipfrac`` is its masked mean). Aggregate the loss like the actor's
        (:func:`~megatron_pacs.algo.grpo.grpo_token_loss`'s sum / T_max per response).
    """
    m = _check(mask, values=values, old_values=old_values, returns=returns)
    if not clip > 0:
        raise ValueError(f"clip={clip} must be > 0 (--value-clip)")
    v = torch.where(m, values.float(), 0.0)
    old = torch.where(m, old_values.float(), 0.0)
    ret = torch.where(m, returns.float(), 0.0)
    v_clipped = old + (v - old).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (v - ret).pow(2), (v_clipped - ret).pow(2)
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return torch.where(m, per_token, 0.0), m & (clipped_loss > unclipped_loss)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - v) / Var(R)`` over flat ``[N]`` tokens (the critic's fit; 1 perfect, <= 0 no better than the
    mean), as a 0-d float64 tensor; NaN when the returns do not vary."""
    r, v = returns.double(), values.double()
    return 1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False)
