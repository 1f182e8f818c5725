"""Per-token KL estimators against a frozen reference policy (docs/algorithm.md §2.7).

With r_t = log pi_ref(y_t) - log pi_theta(y_t) for sampled tokens y_t (Schulman's notation):

    k1 = -r                  unbiased for KL(pi_theta || pi_ref), high variance
    k2 = r^2 / 2             biased, low variance
    k3 = exp(r) - r - 1      unbiased, low variance, always >= 0 (DeepSeekMath's GRPO, the default)

Each returns the estimate's value (for the ``ref/kl`` metric and the loss value) and a surrogate whose gradient is
the term's gradient. k2 and k3 differentiate their value. k1 differentiated directly gives grad log pi_theta, whose
expectation under pi_theta is zero (no KL signal, only noise; verl's ``kl`` mode), so k1 is used in its
score-function form, grad = k1 * grad log pi_theta: the REINFORCE gradient of KL(pi_theta || pi_ref), equal to k2's
gradient. All three gradients are exactly zero at theta = theta_ref.

Shapes: N tokens.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.common import check_choice

__all__ = ["KL_ESTIMATORS", "kl_estimate"]

KL_ESTIMATORS = ("k1", "k2", "k3")
_R_BOUND = 20.0  # |r| above this is clamped before exp (overflow guard; far outside any sane policy drift)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL estimates and their loss surrogates.

    Args:
        logp: ``[N]`` log pi_theta of the sampled tokens (differentiable).
        ref_logp: ``[N]`` log pi_ref of the same tokens (no gradient).
        estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        ``(value [N], surrogate [N])``: the estimate, and a tensor equal to it in value whose gradient is the
        estimator's gradient (see the module docstring), both float32.
    """
    check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    logp = logp.float()
    r = (ref_logp.detach().float() - logp).clamp(-_R_BOUND, _R_BOUND)
    if estimator == "k1":
        value = -r
        # value + k1 * (log pi - sg(log pi)): the value is k1, the gradient k1 * grad log pi
        surrogate = value.detach() + value.detach() * (logp - logp.detach())
        return value.detach(), surrogate
    value = 0.5 * r * r if estimator == "k2" else torch.expm1(r) - r
    return value.detach(), value
