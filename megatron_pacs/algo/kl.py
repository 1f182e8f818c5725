"""Per-token KL estimators against a frozen reference policy (docs/algorithm.md §2.7).

With r_t = log pi_ref(y_t) - log pi_theta(y_t) for sampled tokens y_t ~ pi_theta (Schulman's notation):

    k1  = -r                  unbiased value of KL(pi_theta || pi_ref), high variance
    k2  = r^2 / 2             biased value, low variance
    k3  = exp(r) - r - 1      unbiased value of KL(pi_theta || pi_ref), low variance, >= 0 (DeepSeekMath's GRPO)
    k3+ = k3's value with k2's gradient (verl's ``k3+``, a straight-through surrogate)

What each gradient follows, in expectation over the sampled tokens (per token, given its prefix):

- k2 (and k3+): ``E[(log pi - log pi_ref) grad log pi] = grad KL(pi_theta || pi_ref)``, the KL that ``ref/kl``
  reports.
- k3: ``E[(1 - pi_ref / pi) grad log pi] = -sum_y pi_ref(y) grad log pi(y) = grad KL(pi_ref || pi_theta)``: the
  reverse KL. Its value estimates one KL, its gradient follows the other (both vanish at theta = theta_ref and
  agree to second order near it).
- k1 differentiated directly gives grad log pi, whose expectation is zero (noise only; verl's ``kl`` mode), so k1 is
  used in its score-function form, grad = k1 * grad log pi: equal to k2's gradient. That is the REINFORCE gradient
  of each token's own KL term only; the exact gradient of the sequence-level KL would also weight each token's
  score by the KL of the tokens after it (its effect on later positions), which none of these estimators carry.

Clamps: r is clamped to [-20, 20] before exp (an overflow guard), which zeroes k2's, k3's and k3+'s gradient for a
token beyond it (such a token leaves the KL term's gradient altogether); k3's value is clamped to at most 10 as in
verl (k3 and k3+), so a k3 token with r above ~2.6 (pi_ref > 13 pi) or below -11 contributes its value 10 but no
gradient (k3+ keeps k2's gradient there). All gradients are exactly zero at theta = theta_ref.

Shapes: N tokens.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.checks import check_choice

__all__ = ["KL_ESTIMATORS", "kl_estimate"]

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
_R_BOUND = 20.0  # |r| above this is clamped before exp (overflow guard; far outside any sane policy drift)
_K3_BOUND = 10.0  # verl's clamp of the k3 value


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL estimates and their loss surrogates.

    Args:
        logp: ``[N]`` log pi_theta of the sampled tokens (differentiable).
        ref_logp: ``[N]`` log pi_ref of the same tokens (no gradient).
        estimator: ``k1``, ``k2``, ``k3`` or ``k3+``.

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
    if estimator == "k2":
        value = 0.5 * r * r
        return value.detach(), value
    value = (torch.expm1(r) - r).clamp(-_K3_BOUND, _K3_BOUND)
    if estimator == "k3":
        return value.detach(), value
    k2 = 0.5 * r * r  # k3+: k3's value, k2's gradient
    return value.detach(), value.detach() + (k2 - k2.detach())
