"""Token-level policy losses and their aggregation (``--loss grpo|gspo|cispo``, ``--loss-agg-mode``; docs/algorithm.md
§6).

With r_t = exp(logp_t - logp_old_t) per token and A the response's advantage, each surrogate gives a loss per token
(verl's ``compute_policy_loss_vanilla`` / ``_gspo`` and MiniMax-M1's CISPO, re-derived):

    ppo_clip  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then min(., -A c) where A < 0   (dual clip)
    gspo      the same clip on s_t = sg[s_i] * r_t / sg[r_t], s_i = exp(mean_t log r_t) the response's
              geometric-mean ratio: its value is s_i on every token, its gradient s_i * grad logp_t   (no dual clip)
    cispo     -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp_t: every token keeps a gradient,
              weighted by its clipped importance ratio

and ``--loss-agg-mode`` aggregates them (verl's ``agg_loss`` over the global mini-batch, M responses, R_i tokens):

    token-mean               sum_i sum_t l_it / sum_i R_i
    seq-mean-token-sum       (1 / M) sum_i sum_t l_it
    seq-mean-token-mean      (1 / M) sum_i (1 / R_i) sum_t l_it
    seq-mean-token-sum-norm  (1 / M) sum_i sum_t l_it / T_max         (T_max = --max-response-length; Dr. GRPO)

Every mode is a per-response weight w_i on the token sum, L = (1 / M) sum_i w_i sum_t l_it
(:func:`aggregation_weights`), so a micro-batch's ``loss_sum`` is ``sum_t w_i(t) l_t`` with ``count`` its
responses, and the trainer's one division by the global response count gives L whatever the micro-batches,
packing, data-parallel size or pipeline schedule (docs/algorithm.md §4). The weights are fixed per mini-batch from
the lengths of every data-parallel rank's responses. Responses left out (``--mask-truncated``) get weight 0 and
leave the normalisers.

Legend: N scored tokens of a micro-batch, m its responses, M responses of the mini-batch on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pacs.algo.loss_contract import LossOutput, mean_entry

__all__ = [
    "AGG_MODES",
    "SURROGATES",
    "ClipRange",
    "aggregation_weights",
    "cispo_losses",
    "gspo_losses",
    "policy_token_loss",
    "ppo_clip_losses",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SURROGATES = ("ppo_clip", "gspo", "cispo")
LOG_RATIO_BOUND = 20.0  # verl clamps the token log-ratio to +-20 before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's combined log-ratio from above only


@dataclass(frozen=True)
class ClipRange:
    """The clip of the importance ratio: ``[1 - low, 1 + high]``, and the dual-clip bound ``c`` (None: none)."""

    low: float = 0.2
    high: float = 0.2
    c: float | None = 3.0

    def __post_init__(self) -> None:
        if not 0 < self.low <= 1:
            raise ValueError(f"clip low={self.low} must lie in (0, 1]")
        if not self.high > 0:
            raise ValueError(f"clip high={self.high} must be > 0")
        if self.c is not None and self.c <= 1:
            raise ValueError(f"clip_ratio_c={self.c} must be > 1 (dual clip) or None to disable it")


def aggregation_weights(
    response_lens: torch.Tensor, *, mode: str, max_response_len: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-response weights w_i with ``(1 / M) sum_i w_i sum_t l_it`` = the ``mode`` aggregation (module docstring).

    Args:
        response_lens: ``[M]`` token counts of the mini-batch's responses (every data-parallel rank's).
        mode: One of :data:`AGG_MODES`.
        max_response_len: T_max, ``seq-mean-token-sum-norm``'s constant.
        keep: ``[M]`` bool, False for responses left out of the loss (weight 0, outside the normalisers).

    Returns:
        ``[M]`` float64 weights (all 0 if no response is kept).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {list(AGG_MODES)}")
    lens = torch.as_tensor(response_lens).double()
    kept = torch.ones_like(lens, dtype=torch.bool) if keep is None else keep.to(torch.bool) & (lens > 0)
    num, num_kept = float(lens.numel()), kept.sum().double()
    if mode == "token-mean":
        w = num / (lens * kept).sum().clamp(min=1)
    elif mode == "seq-mean-token-sum":
        w = num / num_kept.clamp(min=1)
    elif mode == "seq-mean-token-mean":
        w = num / (num_kept.clamp(min=1) * lens.clamp(min=1))
    else:
        w = num / (num_kept.clamp(min=1) * max_response_len)
    return torch.where(kept, w, 0.0).expand_as(lens).double()


def ppo_clip_losses(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipRange
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate with asymmetric bounds and dual clip, per token (verl ``compute_policy_loss_vanilla``).

    Args:
        log_ratio: ``[N]`` ``log r`` (clamped to +-20 here), with grad.
        advantages: ``[N]`` float32.
        clip: The clip range.

    Returns:
        ``([N] token losses, [N] clipped (the clipped term won), [N] dual-clipped (A < 0, bounded by -A c))``.
    """
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    loss = torch.maximum(surr, surr_clipped)
    lower = torch.zeros_like(loss, dtype=torch.bool)
    if clip.c is not None:
        bound = -advantages * clip.c
        lower = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, surr_clipped > surr, lower


def gspo_losses(
    token_logp: torch.Tensor,
    token_old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    seq: torch.Tensor,
    lengths: torch.Tensor,
    clip: ClipRange,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (arXiv 2507.18071 eq. 5-7; verl ``compute_policy_loss_gspo``) in its token-level stop-gradient form.

    ``log s_t = logp_t - sg[logp_t] + sg[mean_{t' in i} (logp_t' - logp_old_t')]`` (clamped at 10 from above), then
    the clip of :func:`ppo_clip_losses` without dual clip. A response's tokens must all be in the micro-batch (they
    are: micro-batches never split a response).

    Args:
        token_logp: ``[N]`` current log-probs, with grad.
        token_old_logp: ``[N]`` rollout-policy log-probs.
        advantages: ``[N]`` float32.
        seq: ``[N]`` each token's sequence (0..m-1) in the micro-batch.
        lengths: ``[m]`` tokens per sequence.
        clip: The clip range (``c`` unused).

    Returns:
        ``([N] token losses, [N] clipped)``.
    """
    log_ratio = token_logp.float() - token_old_logp.float()
    seq_log_ratio = torch.segment_reduce(log_ratio.detach(), "sum", lengths=lengths, unsafe=True)
    seq_log_ratio = seq_log_ratio / lengths.clamp(min=1).to(seq_log_ratio)
    logp = token_logp.float()
    log_s = (logp - logp.detach() + seq_log_ratio[seq]).clamp(max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)
    surr = -advantages * s
    surr_clipped = -advantages * s.clamp(1 - clip.low, 1 + clip.high)
    return torch.maximum(surr, surr_clipped), surr_clipped > surr


def cispo_losses(
    token_logp: torch.Tensor, token_old_logp: torch.Tensor, advantages: torch.Tensor, clip: ClipRange
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4-5): ``-sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp_t``.

    Args:
        token_logp: ``[N]`` current log-probs, with grad.
        token_old_logp: ``[N]`` rollout-policy log-probs.
        advantages: ``[N]`` float32.
        clip: The clip range of the importance weight (``c`` unused).

    Returns:
        ``([N] token losses, [N] clipped: the weight was clipped)``.
    """
    logp = token_logp.float()
    log_ratio = (logp.detach() - token_old_logp.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - clip.low, 1 + clip.high)
    return -weight * advantages * logp, weight != ratio


def policy_token_loss(
    surrogate: str,
    token_logp: torch.Tensor,
    token_old_logp: torch.Tensor,
    token_advantages: torch.Tensor,
    *,
    seq: torch.Tensor,
    lengths: torch.Tensor,
    token_scale: torch.Tensor,
    clip: ClipRange,
    prefix: str,
    token_weights: torch.Tensor | None = None,
    token_norm: float = 1.0,
) -> LossOutput:
    """One micro-batch's ``surrogate`` loss under the loss contract: ``loss_sum = sum_t scale_t * w_t * l_t / norm``.

    Args:
        surrogate: One of :data:`SURROGATES`.
        token_logp: ``[N]`` current log-probs, with grad.
        token_old_logp: ``[N]`` rollout-policy log-probs.
        token_advantages: ``[N]`` each token's advantage.
        seq: ``[N]`` each token's sequence (0..m-1).
        lengths: ``[m]`` tokens per sequence.
        token_scale: ``[N]`` each token's aggregation weight (:func:`aggregation_weights` of its response).
        clip: The clip range.
        prefix: Metric namespace (``grpo``).
        token_weights: ``[N]`` truncated importance ratios of off-policy rollouts, or None.
        token_norm: A constant divided out after the sum (T_max for ``seq-mean-token-sum-norm``, with
            ``token_scale`` multiplied by it: exactly 1 per token when nothing is masked).

    Returns:
        ``LossOutput(loss_sum, count=m, metrics)``: ``<prefix>/loss``, ``/clip_frac``, ``/clip_frac_lower``,
        ``/approx_kl``.
    """
    a = token_advantages.float()
    lower = None
    if surrogate == "ppo_clip":
        tok_loss, clipped, lower = ppo_clip_losses(token_logp.float() - token_old_logp.float(), a, clip)
    elif surrogate == "gspo":
        tok_loss, clipped = gspo_losses(token_logp, token_old_logp, a, seq=seq, lengths=lengths, clip=clip)
    elif surrogate == "cispo":
        tok_loss, clipped = cispo_losses(token_logp, token_old_logp, a, clip)
    else:
        raise ValueError(f"surrogate {surrogate!r} is not one of {list(SURROGATES)}")
    if token_weights is not None:
        tok_loss = tok_loss * token_weights.to(tok_loss)
    loss_sum = (tok_loss * token_scale.to(tok_loss)).sum() / token_norm
    num = int(lengths.numel())
    with torch.no_grad():
        n_tok = token_logp.numel()
        m = {
            f"{prefix}/loss": torch.stack([loss_sum.detach(), loss_sum.new_tensor(float(num))]),
            f"{prefix}/clip_frac": mean_entry(clipped.sum().float(), n_tok, tok_loss),
            f"{prefix}/approx_kl": mean_entry(
                (token_old_logp.float() - token_logp.detach().float()).sum(), n_tok, tok_loss
            ),
        }
        if lower is not None:
            m[f"{prefix}/clip_frac_lower"] = mean_entry(lower.sum().float(), n_tok, tok_loss)
    return LossOutput(loss_sum=loss_sum, count=num, metrics=m)
