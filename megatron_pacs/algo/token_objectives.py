"""The token-level objectives: GRPO and its field variants (DAPO, Dr. GRPO), GSPO and CISPO (docs/algorithm.md §6).

One class, :class:`TokenObjective`, serves them all; what differs is the surrogate per token
(:mod:`megatron_pacs.algo.policy_losses`) and the defaults the registry gives (``--loss-agg-mode auto``, the TIS
level). Per optimizer step (``prepare``):

1. the rewards, shaped by DAPO's overlong penalty when ``--overlong-buffer-len > 0``
   (:func:`overlong_penalty`);
2. one advantage per response over the step's groups (``--advantage-estimator``,
   :func:`~megatron_pacs.algo.advantages.outcome_advantages`);
3. one aggregation weight per response of the mini-batch, from every data-parallel rank's response lengths
   (``--loss-agg-mode``, :func:`~megatron_pacs.algo.policy_losses.aggregation_weights`; 0 for truncated responses
   with ``--mask-truncated``);

then each micro-batch's loss is ``sum_t w_i(t) * l_t`` with ``count`` its responses: the trainer's single division
by the global response count gives verl's ``agg_loss`` of the whole mini-batch, whatever the split.

Legend: S responses of the step, M responses of the mini-batch on every rank, N scored tokens of a micro-batch.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.advantages import outcome_advantages
from megatron_pacs.algo.loss_contract import mean_entry, stat_entries
from megatron_pacs.algo.objectives import MiniBatch, Objective, Prepared, StepTensors, TokenLogprobs, count_of
from megatron_pacs.algo.policy_losses import ClipRange, aggregation_weights, policy_token_loss
from megatron_pacs.algo.tokens import TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

__all__ = [
    "CispoObjective",
    "GrpoObjective",
    "GspoObjective",
    "TokenObjective",
    "build_cispo",
    "build_grpo",
    "build_gspo",
    "overlong_penalty",
]


def overlong_penalty(
    response_lens: torch.Tensor, *, max_response_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13; verl's DAPO reward manager), added to the reward.

    ``min(0, -(R_i - (T_max - buffer_len)) / buffer_len * factor)``: 0 up to ``T_max - buffer_len`` tokens, then
    falling linearly to ``-factor`` at ``T_max``.

    Args:
        response_lens: ``[S]`` response lengths in tokens.
        max_response_len: T_max (``--max-response-length``).
        buffer_len: The buffer's length (``--overlong-buffer-len``), > 0.
        factor: The penalty at T_max (``--overlong-penalty-factor``).

    Returns:
        ``[S]`` float64 penalties (<= 0).
    """
    exceed = response_lens.double() - (max_response_len - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


class TokenObjective(Objective):
    """A token-level policy objective: ``surrogate`` per token, group outcome advantages, ``--loss-agg-mode``."""

    old_logprobs = "token"
    #: The per-token loss (:data:`~megatron_pacs.algo.policy_losses.SURROGATES`).
    surrogate: str = "ppo_clip"
    #: The metric namespace.
    prefix: str = "grpo"

    def __init__(self, cfg: LossConfig, max_response_length: int) -> None:
        self.loss_key = f"{self.prefix}/loss"
        self.clip = ClipRange(
            low=cfg.clip_low, high=cfg.clip_high, c=cfg.clip_ratio_c if self.surrogate == "ppo_clip" else None
        )
        self.agg_mode, self.max_response_length = cfg.agg_mode, max_response_length
        self.estimator, self.norm_by_std = cfg.advantage_estimator, cfg.norm_adv_by_std
        self.buffer_len, self.penalty_factor = cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        self.mask_truncated = cfg.mask_truncated
        self.correction = cfg.tis_ratio_level
        self.entropy_coef = cfg.entropy_coef
        self.entropy_grad = cfg.entropy_coef > 0

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return (self.loss_key, "actor/entropy_loss") if self.entropy_grad else (self.loss_key,)

    def prepare(self, mb: MiniBatch) -> Prepared:
        advantages, metrics = self._advantages(mb)
        per_token = self._token_advantages(mb)
        scale, norm = self._aggregation(mb, metrics)
        old_tokens = None if mb.old is None else mb.old.tokens
        token_ratios = None if mb.importance is None else mb.importance.tokens
        # one importance ratio per response (GSPO's geometric level), else per token (token_ratios)
        seq_ratios = mb.importance.seq if mb.importance is not None and token_ratios is None else None
        step = StepTensors(advantages=advantages, rewards=mb.rewards, scale=scale, seq_ratios=seq_ratios)

        def loss(tokens: TokenLogprobs):
            t, idx = step.on(tokens.logp.device), tokens.index
            # No old log-probs means the parameters have not moved since the rollout: the ratio is 1, exactly.
            old = tokens.logp.detach() if old_tokens is None else old_tokens.gather(tokens)
            weights = token_ratios.gather(tokens) if token_ratios is not None else None
            if seq_ratios is not None:
                weights = t["seq_ratios"][idx][tokens.seq]
            adv = t["advantages"][idx][tokens.seq] if per_token is None else per_token.gather(tokens)
            out = policy_token_loss(
                self.surrogate,
                tokens.logp,
                old,
                adv,
                seq=tokens.seq,
                lengths=tokens.lengths,
                token_scale=t["scale"][idx][tokens.seq],
                token_norm=norm,
                clip=self.clip,
                prefix=self.prefix,
                token_weights=weights,
            )
            if per_token is None:
                out.metrics.update(stat_entries(f"{self.prefix}/advantage", t["advantages"][idx]))
            else:
                out.metrics["ppo/advantage/mean"] = mean_entry(adv.sum(), adv.numel(), adv)
            out.metrics[f"{self.prefix}/reward_mean"] = mean_entry(t["rewards"][idx].sum(), len(idx), tokens.logp)
            loss_sum = out.loss_sum
            if self.entropy_grad:  # verl: pg_loss - entropy_coeff * agg_loss(entropy), the same aggregation
                assert tokens.entropy is not None, "the training pass computes the tokens' entropies"
                term = -self.entropy_coef * (tokens.entropy.float() * t["scale"][idx][tokens.seq]).sum() / norm
                out.metrics["actor/entropy_loss"] = torch.stack([term.detach(), term.new_tensor(float(len(idx)))])
                loss_sum = loss_sum + term
            return loss_sum, count_of(tokens), out.metrics

        def token_scale(tokens: TokenLogprobs) -> torch.Tensor:
            return step.on(tokens.logp.device)["scale"][tokens.index][tokens.seq]

        return Prepared(loss, metrics, token_scale, norm)

    def _token_advantages(self, mb: MiniBatch) -> TokenStore | None:
        """Per-token advantages computed before the update (PPO's GAE), or None: one per response
        (:meth:`_advantages`)."""
        del mb
        return None

    def _advantages(self, mb: MiniBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``[S]`` advantages of the step's (shaped) rewards, and the shaping's metric on this rank's rows."""
        lens, rewards = mb.response_lens.long(), mb.rewards.double()
        metrics: dict[str, torch.Tensor] = {}
        if self.buffer_len > 0:
            penalty = overlong_penalty(
                lens, max_response_len=self.max_response_length, buffer_len=self.buffer_len, factor=self.penalty_factor
            )
            rewards = rewards + penalty
            metrics[f"{self.prefix}/overlong_penalty"] = mean_entry(penalty[mb.rows].sum(), len(mb.rows), mb.rewards)
        advantages = outcome_advantages(
            rewards,
            group_size=mb.group_size,
            estimator=self.estimator,
            norm_by_std=self.norm_by_std,
            response_lens=lens,
        )
        return advantages, metrics

    def _aggregation(self, mb: MiniBatch, metrics: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """``[S]`` float32 aggregation weights times ``norm`` (0 outside the mini-batch), and ``norm``.

        T_max is divided out last (``w * T_max`` is exactly 1 without masking), so the default GRPO loss is the
        released one bit for bit: ``sum(l) / T_max``.
        """
        lens = mb.response_lens.long()
        batch_rows = mb.rows if mb.batch_rows is None else mb.batch_rows
        truncated = lens >= self.max_response_length
        keep = ~truncated[batch_rows] if self.mask_truncated else None
        if self.mask_truncated:
            metrics[f"{self.prefix}/truncated_frac"] = mean_entry(truncated[mb.rows].sum(), len(mb.rows), mb.rewards)
        norm = float(self.max_response_length) if self.agg_mode == "seq-mean-token-sum-norm" else 1.0
        weights = aggregation_weights(
            lens[batch_rows], mode=self.agg_mode, max_response_len=self.max_response_length, keep=keep
        )
        scale = torch.zeros(lens.numel(), dtype=torch.float32)
        scale[batch_rows] = (weights * norm).float()
        return scale, norm


class GrpoObjective(TokenObjective):
    """GRPO (``--loss grpo``; DAPO and Dr. GRPO by its flags): PPO's clipped surrogate per token."""


class GspoObjective(TokenObjective):
    """GSPO (``--loss gspo``): the clip on the response's geometric-mean ratio, token-level stop-gradient form."""

    surrogate, prefix = "gspo", "gspo"


class CispoObjective(TokenObjective):
    """CISPO (``--loss cispo``): REINFORCE weighted by clipped, stop-gradient token importance ratios."""

    surrogate, prefix = "cispo", "cispo"


def build_grpo(loss: LossConfig, batch: BatchConfig) -> Objective:
    """GRPO (``--loss grpo``)."""
    return GrpoObjective(loss, batch.max_response_length)


def build_gspo(loss: LossConfig, batch: BatchConfig) -> Objective:
    """GSPO (``--loss gspo``)."""
    return GspoObjective(loss, batch.max_response_length)


def build_cispo(loss: LossConfig, batch: BatchConfig) -> Objective:
    """CISPO (``--loss cispo``)."""
    return CispoObjective(loss, batch.max_response_length)
