"""PPO's critic phase of a training step, on every rank: values, GAE, the critic's update (docs/algorithm.md §6.5).

:func:`update_critic` runs before the actor's update (:func:`megatron_pacs.update.update_policy`), on the same
micro-batches the actor will use (the step's :class:`~megatron_pacs.data.layout.StepLayout`):

1. with ``--reward-kl-coef``: the actor's and the reference's token log-probs of every response, in one
   forward-only schedule, for the per-token penalty ``-coef * (log pi_old - log pi_ref)`` in the reward;
2. the critic's values V_old of every response token (forward only);
3. GAE over this rank's responses (:func:`~megatron_pacs.algo.gae.gae_advantages`), the whitening's mean and
   variance summed over the data-parallel group so they are the step's;
4. the critic's optimizer steps, one per mini-batch and epoch, on the clipped value loss
   (:func:`~megatron_pacs.algo.ppo.value_loss`), normalised once per mini-batch by Megatron.

It returns the whitened advantages for the actor's :class:`~megatron_pacs.algo.objectives.MiniBatch`. Values,
returns and advantages exist on the last pipeline stage only, where the losses are computed; GAE runs there, and
the data-parallel group of a last-stage rank holds only last-stage ranks.

Legend: S responses of the step, B this rank's responses, T their longest response.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pacs.algo.gae import gae_advantages
from megatron_pacs.algo.ppo import value_loss
from megatron_pacs.algo.tokens import TokenStore
from megatron_pacs.config import BatchConfig
from megatron_pacs.config.critic import CriticConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.critic import Critic
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.update import reduce_over_ranks, step_layout
from megatron_pacs.utils.timing import PhaseTimer

__all__ = ["update_critic"]


def update_critic(
    critic: Critic,
    batch: RolloutBatch,
    cfg: BatchConfig,
    critic_cfg: CriticConfig,
    groups: ParallelGroups,
    timer: PhaseTimer,
    *,
    actor: Actor,
    temperature: float,
    reference: ReferencePolicy | None = None,
) -> tuple[TokenStore, dict[str, float]]:
    """The critic's phase of one training step on this rank's share of ``batch`` (collective).

    Args:
        critic: The value model.
        batch: The step's rollouts (this rank's share held).
        cfg: Batch settings (mini-batches, epochs, T_max).
        critic_cfg: GAE, value clip, reward KL.
        groups: Parallel groups.
        timer: The step's phase timer (``critic_values``, ``gae``, ``critic_update``).
        actor: The policy (its log-probs for the reward KL).
        temperature: The sampling temperature the log-probs refer to.
        reference: The reference policy, needed with ``--reward-kl-coef``.

    Returns:
        ``(advantages, metrics)``: the whitened per-token advantages of the step's responses (this rank's, last
        pipeline stage; zeros elsewhere) and the critic's metrics reduced over every rank.
    """
    layout = step_layout(batch, cfg, groups, whole_groups=False, align=actor.token_alignment)
    minis = list(range(layout.num_mini_batches))
    everything = layout.micro_batches(minis)
    kl = None
    if critic_cfg.reward_kl_coef > 0:
        if reference is None:
            raise ValueError("--reward-kl-coef needs the reference policy's log-probs; pass the ReferencePolicy")
        with timer.phase("ref_logprobs"):
            ref, old = reference.logprobs(
                everything, batch.response_lens, temperature=temperature, tokens=True, actor=actor, actor_tokens=True
            )
        assert ref.tokens is not None and old is not None and old.tokens is not None
        kl = TokenStore(old.tokens.values - ref.tokens.values, old.tokens.offsets)
    with timer.phase("critic_values"):
        values = critic.values(everything, batch.response_lens)
    rows = torch.tensor(layout.rows(minis), dtype=torch.long)
    parts: list[dict[str, torch.Tensor]] = []
    with timer.phase("gae"):
        advantages = TokenStore.zeros(batch.response_lens, values.values.device)
        returns = TokenStore.zeros(batch.response_lens, values.values.device)
        if groups.is_last_stage:
            parts.append(_gae(values, kl, batch, rows, critic_cfg, groups, advantages, returns))
    results = []
    loss = value_loss(values, returns, clip=critic_cfg.value_clip, max_response_length=cfg.max_response_length)
    with timer.phase("critic_update"):
        for _ in range(cfg.ppo_epochs):
            for k in minis:
                result = critic.optimizer_step(layout.micro_batches([k]), loss)
                parts.extend(result.reports)
                results.append(result)
    metrics = reduce_over_ranks(parts)
    taken = [r for r in results if not r.skipped]
    metrics["critic/skipped_steps"] = float(len(results) - len(taken))
    if taken:
        metrics["critic/grad_norm"] = sum(r.grad_norm for r in taken) / len(taken)
        metrics["critic/lr"] = taken[-1].lr
    return advantages, metrics


def _dp_sum(groups: ParallelGroups):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if groups.dp_size > 1:
            dist.all_reduce(t, group=groups.dp_group)
        return t

    return reduce


def _gae(
    values: TokenStore,
    kl: TokenStore | None,
    batch: RolloutBatch,
    rows: torch.Tensor,
    critic_cfg: CriticConfig,
    groups: ParallelGroups,
    advantages: TokenStore,
    returns: TokenStore,
) -> dict[str, torch.Tensor]:
    """GAE over this rank's ``rows`` (last stage), written into ``advantages`` and ``returns``; the step's value,
    return and advantage means and the critic's explained variance as metric entries."""
    device = values.values.device
    lens = batch.response_lens.to(device)[rows.to(device)]
    width = int(lens.max()) if rows.numel() else 1
    cols = torch.arange(width, device=device)
    mask = cols[None] < lens[:, None]
    flat = (values.offsets[rows.to(device)][:, None] + cols[None])[mask]  # [sum R_i] store positions, row by row

    def padded(store: TokenStore) -> torch.Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        out[mask] = store.values[flat].float()
        return out

    v = padded(values)
    token_rewards = torch.zeros_like(v)
    if rows.numel():  # the outcome reward on each response's last token
        token_rewards[torch.arange(len(rows), device=device), lens - 1] = batch.rewards.to(device)[rows.to(device)]
    if kl is not None:
        token_rewards = token_rewards - critic_cfg.reward_kl_coef * padded(kl)
    reduce = _dp_sum(groups)
    adv, ret = gae_advantages(
        token_rewards, v, mask, gamma=critic_cfg.gae_gamma, lam=critic_cfg.gae_lambda, reduce=reduce
    )
    advantages.values[flat] = adv[mask]
    returns.values[flat] = ret[mask]
    vm, rm, am = v[mask].double(), ret[mask].double(), adv[mask].double()
    n = float(vm.numel())
    # explained variance 1 - Var(R - V) / Var(R) over the step's tokens, from sums reduced over data parallelism
    d = rm - vm
    sums = reduce(
        torch.stack(
            [
                torch.tensor(n, dtype=torch.float64, device=device),
                rm.sum(),
                rm.square().sum(),
                d.sum(),
                d.square().sum(),
            ]
        )
    )
    count, r1, r2, d1, d2 = sums.tolist()
    var_r, var_d = r2 / count - (r1 / count) ** 2, d2 / count - (d1 / count) ** 2
    explained = 1.0 - var_d / var_r if var_r > 0 else float("nan")

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float(x.sum()), n])

    return {
        "critic/values/mean": mean(vm),
        "critic/returns/mean": mean(rm),
        "critic/advantages/mean": mean(am),
        "critic/vf_explained_var": torch.tensor([explained, 1.0]),
    }
