"""The PACS loss (arXiv 2509.02522): RLVR as supervised learning of an implicit critic.

For a group of N responses to one prompt with 0/1 rewards R_i and sequence log-likelihoods l_i (token sums over
the response), PACS scores each response by the policy itself, centres the scores within the group into logits,
and trains with weighted binary cross-entropy (docs/algorithm.md §2 and §3):

    s_i = beta * (l_i - l_i^old)                    # score="log_ratio"  (or beta * l_i / L_i, "mean_logp")
    A_i = s_i - mean_{j != i} s_j                   # advantage="rloo"   (or grpo, grpo_no_std, naive)
    L   = (1 / S) * sum_i w_i * BCEWithLogits(A_i, R_i)   # w: per-group class balance

``pacs_loss`` returns ``(loss_sum, count)`` with ``loss_sum / count == L`` so callers normalise once globally.

Two-phase group gradient: dL/ds has a closed form per group (``pacs_score_grads``), so the exact gradient is the
gradient of the surrogate ``sum_i c_i * s_i(theta)`` with c computed from phase-1 scores. The surrogate can be
back-propagated through any micro-batching, even one that splits groups (``pacs_surrogate``).

Shapes: S responses (groups contiguous), G groups, N group size; ``_GN`` tensors are ``[G, N]`` views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_pacs.algo.checks import (
    as_float_vector,
    check_1d,
    check_choice,
    check_finite,
    check_groups,
    check_rewards,
)
from megatron_pacs.algo.loss_contract import LossOutput, mean_entry
from megatron_pacs.algo.metrics import pacs_metrics
from megatron_pacs.algo.registry import Registry
from megatron_pacs.utils.logging import get_logger

__all__ = [
    "ADVANTAGES",
    "DEGENERATE_STD",
    "GRPO_EPS",
    "SCORES",
    "WEIGHTS",
    "compute_scores",
    "degenerate_std_metrics",
    "group_advantages",
    "group_weights",
    "pacs_loss",
    "pacs_score_grads",
    "pacs_surrogate",
    "warn_degenerate_std",
]

SCORES = ("log_ratio", "mean_logp")
GRPO_EPS = 1e-6
DEGENERATE_STD = 1e-4
"""A group whose score std is below this, under an estimator dividing by it, has its noise amplified toward 1/eps."""
_STD_DIVIDING = ("grpo",)
_warned_degenerate_std = False


@dataclass(frozen=True)
class AdvantageEstimator:
    """A group-centring of scores into logits, with its closed-form vector-Jacobian product.

    Attributes:
        forward: ``s_GN -> A_GN``.
        vjp: ``(s_GN, e_GN) -> c_GN`` with ``c = (dA/ds)^T e``, i.e. dL/ds given ``e = dL/dA``.
        needs_pairs: True when the estimator is undefined for N = 1.
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    vjp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    needs_pairs: bool


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage")
WEIGHTS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("weights")


def _rloo(s: torch.Tensor) -> torch.Tensor:
    n = s.shape[-1]
    return s - (s.sum(-1, keepdim=True) - s) / (n - 1)


def _rloo_vjp(s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    # dA_i/ds_k = 1 if i == k else -1/(n-1)  =>  c_k = e_k - (sum_i e_i - e_k) / (n-1)
    n = e.shape[-1]
    return e - (e.sum(-1, keepdim=True) - e) / (n - 1)


def _grpo(s: torch.Tensor) -> torch.Tensor:
    return (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + GRPO_EPS)


def _grpo_vjp(s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    # A_i = d_i / (sd + eps), d = s - mean(s), sd unbiased; d sd / d s_k = d_k / ((n-1) sd).
    # c_k = (e_k - mean e) / (sd + eps) - (sum_i e_i d_i) d_k / ((n-1) sd (sd + eps)^2).
    # At sd == 0 every d_i is 0 and the second term is 0 (autograd would give NaN there).
    n = s.shape[-1]
    d = s - s.mean(-1, keepdim=True)
    sd = s.std(-1, keepdim=True)
    first = (e - e.mean(-1, keepdim=True)) / (sd + GRPO_EPS)
    safe_sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    second = (e * d).sum(-1, keepdim=True) * d / ((n - 1) * safe_sd * (sd + GRPO_EPS) ** 2)
    return first - torch.where(sd > 0, second, torch.zeros_like(second))


def _centre(s: torch.Tensor) -> torch.Tensor:
    return s - s.mean(-1, keepdim=True)


ADVANTAGES.register("rloo")(AdvantageEstimator(_rloo, _rloo_vjp, needs_pairs=True))
ADVANTAGES.register("grpo")(AdvantageEstimator(_grpo, _grpo_vjp, needs_pairs=True))
ADVANTAGES.register("grpo_no_std")(AdvantageEstimator(_centre, lambda s, e: _centre(e), needs_pairs=True))
ADVANTAGES.register("naive")(AdvantageEstimator(lambda s: s, lambda s, e: e, needs_pairs=False))


def degenerate_std_metrics(scores: torch.Tensor, *, group_size: int, advantage: str) -> dict[str, torch.Tensor]:
    """``pacs/degenerate_std_groups``: the share of groups whose score std is below ``DEGENERATE_STD`` (1e-4), for
    an estimator that divides by it (``grpo``; docs/algorithm.md §3.2); no device sync.

    Args:
        scores: ``[S]`` scores, groups of ``group_size`` contiguous.
        group_size: N.
        advantage: The estimator; others than ``grpo`` return ``{}``.

    Returns:
        ``{"pacs/degenerate_std_groups": [count, groups]}`` or ``{}``.
    """
    if advantage not in _STD_DIVIDING:
        return {}
    with torch.no_grad():
        sd = scores.detach().view(-1, group_size).std(-1)
        return {"pacs/degenerate_std_groups": mean_entry((sd < DEGENERATE_STD).sum().float(), sd.numel(), scores)}


def warn_degenerate_std(metrics: dict[str, float]) -> None:
    """Warn once per process when a step's reduced metrics count groups with a degenerate score std."""
    global _warned_degenerate_std
    share = metrics.get("pacs/degenerate_std_groups", 0.0)
    if share > 0 and not _warned_degenerate_std:
        _warned_degenerate_std = True
        get_logger(__name__).warning(
            "pacs/degenerate_std_groups=%.3g: groups with a score std below %g under --pacs-advantage grpo; their "
            "logits and gradients are divided by std + %g, amplifying rounding noise up to 1/%g-fold (always on "
            "the first mini-batch of a log_ratio step, where pi == pi_old). Use --clip-grad, or --pacs-advantage "
            "rloo / grpo_no_std (warned once)",
            share,
            DEGENERATE_STD,
            GRPO_EPS,
            GRPO_EPS,
        )


@WEIGHTS.register("balanced")
def _balanced(pos_GN: torch.Tensor) -> torch.Tensor:
    # sklearn's compute_class_weight("balanced") per group in closed form: n/(2k) for the k positives,
    # n/(2(n-k)) for the negatives; single-class groups keep weight 1 (reference mode "question").
    n = pos_GN.shape[-1]
    k = pos_GN.sum(-1, keepdim=True)
    mixed = (k > 0) & (k < n)
    w_pos = n / (2 * k.clamp(min=1))
    w_neg = n / (2 * (n - k).clamp(min=1))
    return torch.where(mixed, torch.where(pos_GN > 0, w_pos, w_neg), torch.ones_like(pos_GN))


WEIGHTS.register("none")(lambda pos_GN: torch.ones_like(pos_GN))
WEIGHTS.register("only_positive")(lambda pos_GN: pos_GN.clone())
WEIGHTS.register("only_negative")(lambda pos_GN: 1.0 - pos_GN)


def compute_scores(
    seq_logp: torch.Tensor,
    seq_old_logp: torch.Tensor | None = None,
    *,
    beta: float = 1.0,
    score: str = "log_ratio",
    response_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """PACS scores (implicit rewards), docs/algorithm.md §2.1.

    Args:
        seq_logp: ``[S]`` sequence log-likelihoods under the current policy (token sums, masked).
        seq_old_logp: ``[S]`` the same under the rollout policy; required for ``score="log_ratio"``.
        beta: Temperature of the implicit critic.
        score: ``"log_ratio"`` (beta * (l - l_old)) or ``"mean_logp"`` (beta * l / L).
        response_lens: ``[S]`` response lengths in tokens; required for ``score="mean_logp"``.

    Returns:
        ``[S]`` scores, differentiable w.r.t. ``seq_logp``.
    """
    check_choice("score", score, SCORES)
    if score == "log_ratio":
        if seq_old_logp is None:
            raise ValueError("score='log_ratio' needs seq_old_logp (the rollout policy's sequence log-probs)")
        return beta * (seq_logp - seq_old_logp.to(seq_logp.dtype))
    if response_lens is None:
        raise ValueError("score='mean_logp' needs response_lens (tokens per response) to normalise by length")
    lens = torch.as_tensor(response_lens, device=seq_logp.device)
    if bool((lens <= 0).any()):
        raise ValueError("response_lens must be positive for score='mean_logp'; drop empty responses first")
    return beta * seq_logp / lens.to(seq_logp.dtype)


def group_advantages(scores: torch.Tensor, *, group_size: int, advantage: str = "rloo") -> torch.Tensor:
    """Group-centred logits A from scores s, docs/algorithm.md §2.3.

    Args:
        scores: ``[S]`` scores, groups of ``group_size`` contiguous.
        group_size: N.
        advantage: ``rloo`` | ``grpo`` | ``grpo_no_std`` | ``naive``.

    Returns:
        ``[S]`` logits.
    """
    est = ADVANTAGES.get(advantage)
    check_groups(scores.shape[0], group_size, need_pairs=est.needs_pairs)
    return est.forward(scores.view(-1, group_size)).reshape(-1)


def group_weights(rewards: torch.Tensor, *, group_size: int, weights: str = "balanced") -> torch.Tensor:
    """Per-response BCE weights, docs/algorithm.md §2.4.

    A response counts as positive when its reward is > 0.5 (exactly the 0/1 classes for binary rewards).

    Args:
        rewards: ``[S]`` rewards in [0, 1].
        group_size: N.
        weights: ``balanced`` | ``none`` | ``only_positive`` | ``only_negative``.

    Returns:
        ``[S]`` float weights.
    """
    fn = WEIGHTS.get(weights)
    check_groups(rewards.shape[0], group_size, need_pairs=False)
    pos = (rewards > 0.5).to(_compute_dtype(rewards)).view(-1, group_size)
    return fn(pos).reshape(-1)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # bf16/fp16 inputs are upcast: the sigmoid and the group sums need float32 accuracy.
    return torch.promote_types(t.dtype, torch.float32)


def _validate(seq_logp, seq_old_logp, rewards, group_size, score, advantage, weights):
    check_choice("score", score, SCORES)
    check_choice("weights", weights, WEIGHTS.names())
    est = ADVANTAGES.get(advantage)
    check_1d("seq_logp", seq_logp)
    rewards = as_float_vector("rewards", rewards, seq_logp)
    check_groups(seq_logp.shape[0], group_size, need_pairs=est.needs_pairs)
    check_finite("seq_logp", seq_logp.detach())
    if seq_old_logp is not None:
        check_1d("seq_old_logp", seq_old_logp, seq_logp.shape[0])
        check_finite("seq_old_logp", seq_old_logp)
    check_rewards(rewards)
    return rewards


def pacs_loss(
    seq_logp: torch.Tensor,
    seq_old_logp: torch.Tensor | None,
    rewards: torch.Tensor,
    *,
    group_size: int,
    beta: float = 1.0,
    score: str = "log_ratio",
    advantage: str = "rloo",
    weights: str = "balanced",
    response_lens: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
) -> LossOutput:
    """The PACS loss over whole groups, as a global sum and count.

    ``loss_sum / count`` equals the reference's ``BCEWithLogitsLoss(weight=w)(A, R)`` mean (docs/algorithm.md
    §2.5). The computation runs in at least float32 (bf16 inputs are upcast).

    Args:
        seq_logp: ``[S]`` current-policy sequence log-likelihoods (masked token sums), with grad.
        seq_old_logp: ``[S]`` rollout-policy sequence log-likelihoods (no grad), or None for ``mean_logp``.
        rewards: ``[S]`` rewards in [0, 1] (the BCE labels).
        group_size: N, responses per prompt; S must be a multiple and groups contiguous.
        beta: Critic temperature.
        score: ``log_ratio`` | ``mean_logp``.
        advantage: ``rloo`` | ``grpo`` | ``grpo_no_std`` | ``naive``.
        weights: ``balanced`` | ``none`` | ``only_positive`` | ``only_negative``.
        response_lens: ``[S]`` token counts, needed by ``mean_logp``.
        sample_weights: ``[S]`` multipliers of the BCE weights (truncated importance ratios of off-policy
            rollouts, docs/algorithm.md §5.1), or None.

    Returns:
        ``LossOutput(loss_sum, count=S, metrics)`` with the docs/algorithm.md §7 metrics.
    """
    rewards = _validate(seq_logp, seq_old_logp, rewards, group_size, score, advantage, weights)
    dt = _compute_dtype(seq_logp)
    s = compute_scores(
        seq_logp.to(dt),
        None if seq_old_logp is None else seq_old_logp.to(dt),
        beta=beta,
        score=score,
        response_lens=response_lens,
    )
    adv = group_advantages(s, group_size=group_size, advantage=advantage)
    class_w = w = group_weights(rewards, group_size=group_size, weights=weights)
    if sample_weights is not None:
        w = w * sample_weights.to(w)
    loss_sum = F.binary_cross_entropy_with_logits(adv, rewards.to(dt), weight=w.to(dt), reduction="sum")
    metrics = pacs_metrics(s, adv, rewards, class_w, group_size=group_size, sample_weights=sample_weights)
    metrics.update(degenerate_std_metrics(s, group_size=group_size, advantage=advantage))
    metrics["pacs/loss"] = torch.stack([loss_sum.detach(), loss_sum.new_tensor(float(s.numel()))])
    return LossOutput(loss_sum=loss_sum, count=int(s.numel()), metrics=metrics)


def pacs_score_grads(
    scores: torch.Tensor,
    rewards: torch.Tensor,
    *,
    group_size: int,
    advantage: str = "rloo",
    weights: str = "balanced",
    normalizer: float,
    sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Closed-form dL/ds of the PACS loss (docs/algorithm.md §3.2), for the two-phase group gradient.

    With ``e_i = w_i * (sigmoid(A_i) - R_i) / normalizer`` (dL/dA), returns ``c = (dA/ds)^T e`` per group; for
    rloo ``c_k = e_k - (1/(N-1)) * sum_{i != k} e_i``. Back-propagating ``sum_i c_i * s_i(theta)`` through any
    split of the responses then yields exactly ``dL/dtheta`` for ``L = sum_i w_i BCE(A_i, R_i) / normalizer``.

    Args:
        scores: ``[S]`` phase-1 scores (no grad needed), groups contiguous.
        rewards: ``[S]`` rewards in [0, 1].
        group_size: N.
        advantage: ``rloo`` | ``grpo`` | ``grpo_no_std`` | ``naive``.
        weights: ``balanced`` | ``none`` | ``only_positive`` | ``only_negative``.
        normalizer: The global count the loss is divided by (responses in the optimizer step's mini-batch,
            summed over data-parallel ranks).
        sample_weights: ``[S]`` multipliers of the BCE weights (see :func:`pacs_loss`), or None.

    Returns:
        ``[S]`` coefficients ``c`` (float32, or float64 for float64 scores), detached.
    """
    est = ADVANTAGES.get(advantage)
    check_choice("weights", weights, WEIGHTS.names())
    check_1d("scores", scores)
    rewards = as_float_vector("rewards", rewards, scores)
    check_groups(scores.shape[0], group_size, need_pairs=est.needs_pairs)
    check_finite("scores", scores.detach())
    check_rewards(rewards)
    if not normalizer > 0:
        raise ValueError(f"normalizer={normalizer} must be > 0 (the number of responses the loss is averaged over)")
    dt = _compute_dtype(scores)
    with torch.no_grad():
        s_GN = scores.detach().to(dt).view(-1, group_size)
        r_GN = rewards.to(dt).view(-1, group_size)
        w = group_weights(rewards, group_size=group_size, weights=weights).to(dt)
        if sample_weights is not None:
            w = w * sample_weights.to(w)
        w_GN = w.view(-1, group_size)
        e_GN = w_GN * (torch.sigmoid(est.forward(s_GN)) - r_GN) / normalizer
        return est.vjp(s_GN, e_GN).reshape(-1)


def pacs_surrogate(scores: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """Phase 2 of the group gradient: ``sum_i c_i * s_i(theta)``, a scalar whose gradient is the PACS gradient.

    Its value is not the loss (report the phase-1 loss instead). Any subset of responses may be passed, in any
    micro-batch; the gradients of the parts add up to the full gradient.

    Args:
        scores: ``[M]`` scores of this micro-batch's responses, with grad (see :func:`compute_scores`).
        coeffs: ``[M]`` their coefficients from :func:`pacs_score_grads`.

    Returns:
        Scalar tensor.
    """
    if scores.shape != coeffs.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and coeffs {tuple(coeffs.shape)} must have one shape")
    return (coeffs.detach().to(scores.dtype) * scores).sum()
