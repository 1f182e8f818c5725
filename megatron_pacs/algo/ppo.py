"""The PPO baseline's actor objective (``--loss ppo``, docs/algorithm.md §6.5): GRPO's token-level clipped surrogate
(:func:`~megatron_pacs.algo.grpo.grpo_token_loss`) with per-token advantages from GAE over a learned critic.

The advantages are the step's, computed once before the update (:func:`~megatron_pacs.algo.gae.gae_advantages`
over the critic's values, whitened over every response of the step) and handed in as a
:class:`~megatron_pacs.algo.tokens.TokenStore` (:attr:`MiniBatch.advantages`), so micro-batches may split groups
and responses freely. The loss is aggregated like GRPO's (``seq-mean-token-sum-norm``: per response, the token sum
over T_max; ``count`` = responses), as the released run aggregates it. :func:`value_loss` is the critic's loss in the
same aggregation, so Megatron's one division by the global response count normalises it over the whole mini-batch,
never per micro-batch (verl PR #6957: a per-micro-batch mean made the critic's effective rate follow the
micro-batch count).

Legend: N scored tokens of a micro-batch, m its responses.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.gae import clipped_value_loss
from megatron_pacs.algo.grpo import grpo_token_loss
from megatron_pacs.algo.loss_contract import mean_entry
from megatron_pacs.algo.objectives import MicroBatchLoss, MiniBatch, Objective, Prepared, StepTensors, count_of
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

__all__ = ["PpoObjective", "build_ppo", "value_loss"]


class PpoObjective(Objective):
    """PPO's actor: token-level PPO clip (``--clip-ratio``, dual clip ``--clip-ratio-c``) on the critic's GAE
    advantages."""

    loss_key = "grpo/loss"
    old_logprobs = "token"

    def __init__(self, cfg: LossConfig, max_response_length: int) -> None:
        self.clip_ratio, self.clip_ratio_c = cfg.clip_ratio, cfg.clip_ratio_c
        self.max_response_length = max_response_length
        self.correction = cfg.tis_ratio_level

    def prepare(self, mb: MiniBatch) -> Prepared:
        if mb.advantages is None:
            raise ValueError("--loss ppo needs the critic's per-token advantages (MiniBatch.advantages)")
        advantages = mb.advantages
        old_tokens = None if mb.old is None else mb.old.tokens
        ratios = None if mb.importance is None else mb.importance.tokens
        step = StepTensors(rewards=mb.rewards)

        def loss(tokens: TokenLogprobs):
            t, idx = step.on(tokens.logp.device), tokens.index
            # No old log-probs means the parameters have not moved since the rollout: the ratio is 1, exactly.
            old = tokens.logp.detach() if old_tokens is None else old_tokens.gather(tokens)
            adv = advantages.gather(tokens)
            out = grpo_token_loss(
                tokens.logp,
                old,
                adv,
                num_responses=tokens.num_sequences,
                max_response_len=self.max_response_length,
                clip_ratio=self.clip_ratio,
                clip_ratio_c=self.clip_ratio_c,
                rewards=t["rewards"][idx],
                token_weights=None if ratios is None else ratios.gather(tokens),
            )
            out.metrics["ppo/advantage/mean"] = mean_entry(adv.sum(), adv.numel(), adv)
            return out.loss_sum, count_of(tokens), out.metrics

        return Prepared(loss)


def build_ppo(loss: LossConfig, batch: BatchConfig) -> Objective:
    """PPO (``--loss ppo``); the critic is the trainer's (:mod:`megatron_pacs.mcore.critic`)."""
    return PpoObjective(loss, batch.max_response_length)


def value_loss(old_values: TokenStore, returns: TokenStore, *, clip: float, max_response_length: int) -> MicroBatchLoss:
    """The critic's micro-batch loss: :func:`~megatron_pacs.algo.gae.clipped_value_loss` per token, summed per
    response over T_max, ``count`` = responses (the actor's aggregation).

    Args:
        old_values: The step's values V_old (those the returns were built from), per response token.
        returns: The step's GAE returns R, per response token.
        clip: ``--value-clip``.
        max_response_length: T_max.

    Returns:
        ``(scored tokens whose logp holds the values v) -> (loss_sum, count, report)``; the report holds
        ``critic/vf_loss``, ``critic/vf_clipfrac`` and ``critic/vpred_mean``.
    """

    def loss(tokens: TokenLogprobs):
        v = tokens.logp
        old, ret = old_values.gather(tokens), returns.gather(tokens)
        mask = torch.ones_like(v, dtype=torch.bool)[None]
        per_token, clipped = clipped_value_loss(v[None], old[None], ret[None], mask, clip=clip)
        loss_sum = per_token.sum() / max_response_length
        n, m = v.numel(), tokens.num_sequences
        report = {
            "critic/vf_loss": torch.stack([loss_sum.detach(), loss_sum.new_tensor(float(m))]),
            "critic/vf_clipfrac": mean_entry(clipped.sum().float(), n, v),
            "critic/vpred_mean": mean_entry(v.detach().sum(), n, v),
        }
        return loss_sum, count_of(tokens), report

    return loss
