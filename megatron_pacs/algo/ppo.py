"""The PPO baseline's actor objective (``--loss ppo``, docs/algorithm.md §6.5): the token-level clipped surrogate
of GRPO (:class:`~megatron_pacs.algo.token_objectives.TokenObjective`, with its clip variants, ``--loss-agg-mode``,
``--entropy-coef`` and ``--mask-truncated``) on per-token advantages from GAE over a learned critic.

The advantages are the step's, computed once before the update (:func:`~megatron_pacs.algo.gae.gae_advantages`
over the critic's values, whitened over every response of the step) and handed in as a
:class:`~megatron_pacs.algo.tokens.TokenStore` (:attr:`MiniBatch.advantages`), so micro-batches may split groups
and responses freely. The default aggregation is the released run's (``seq-mean-token-sum-norm``: per response, the
token sum over T_max; ``count`` = responses). :func:`value_loss` is the critic's loss in that aggregation, whatever
``--loss-agg-mode`` (the released run's critic), so Megatron's one division by the global response count normalises
it over the whole mini-batch, never per micro-batch (verl PR #6957: a per-micro-batch mean made the critic's
effective rate follow the micro-batch count).

Legend: N scored tokens of a micro-batch, m its responses.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.gae import clipped_value_loss
from megatron_pacs.algo.loss_contract import mean_entry
from megatron_pacs.algo.objectives import MicroBatchLoss, MiniBatch, Objective, count_of
from megatron_pacs.algo.token_objectives import TokenObjective
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig

__all__ = ["PpoObjective", "build_ppo", "value_loss"]


class PpoObjective(TokenObjective):
    """PPO's actor: the token-level clipped surrogate of GRPO (``--clip-ratio``, ``--clip-ratio-low/-high``, dual
    clip ``--clip-ratio-c``, ``--loss-agg-mode``, ``--entropy-coef``, ``--mask-truncated``) on the critic's GAE
    advantages instead of group ones."""

    def _token_advantages(self, mb: MiniBatch) -> TokenStore:
        if mb.advantages is None:
            raise ValueError("--loss ppo needs the critic's per-token advantages (MiniBatch.advantages)")
        return mb.advantages

    def _advantages(self, mb: MiniBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """No group advantages: GAE's per-token ones are the step's (:meth:`_token_advantages`)."""
        return torch.zeros(mb.rewards.numel(), dtype=torch.float64), {}


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
