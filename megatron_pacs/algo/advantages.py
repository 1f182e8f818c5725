"""Outcome advantages of the token-level group objectives (``--advantage-estimator``, docs/algorithm.md §6.2).

Each estimator maps a step's rewards (groups of N contiguous responses) to one advantage per response, which the
objective then gives to every token of the response. verl's estimators of the same names
(``verl.trainer.ppo.core_algos.compute_*_outcome_advantage``) are the definitions matched:

    grpo                          (R_i - mean_g R) / (std_g R + 1e-6)     (std unbiased; --no-norm-adv-by-std: no
                                                                           division, Dr. GRPO)
    rloo                          N / (N - 1) * (R_i - mean_g R)          (= R_i - mean of the other N - 1)
    opo                           R_i - sum_g(L_j R_j) / sum_g L_j        (length-weighted baseline, L_j tokens)
    reinforce_plus_plus_baseline  whiten(R_i - mean_g R) over the step's tokens: the group-centred reward, then
                                  (x - mu) / sqrt(var + 1e-8) with the token-weighted mean and unbiased variance of
                                  every response token of the step (verl's ``masked_whiten``)

Advantages depend only on rewards and lengths, so they are computed once per step, over every response of every
rank, and micro-batches may then be cut freely.

Legend: S responses of the step, N group size, G = S / N groups.
"""

from __future__ import annotations

import torch

from megatron_pacs.algo.checks import check_1d, check_finite, check_groups
from megatron_pacs.algo.grpo import grpo_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "WHITEN_EPS", "outcome_advantages"]

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo")
WHITEN_EPS = 1e-8


def outcome_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    response_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One advantage per response under ``estimator`` (see the module docstring).

    Args:
        rewards: ``[S]`` rewards (shaped, e.g. by the overlong penalty), groups of ``group_size`` contiguous.
        group_size: N >= 2.
        estimator: One of :data:`ADVANTAGE_ESTIMATORS`.
        norm_by_std: ``grpo`` only: divide by the group's std (False: Dr. GRPO).
        response_lens: ``[S]`` response lengths in tokens; needed by ``opo`` and
            ``reinforce_plus_plus_baseline``.

    Returns:
        ``[S]`` float32 advantages (no grad).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {list(ADVANTAGE_ESTIMATORS)}")
    if estimator == "grpo":
        return grpo_advantages(rewards, group_size=group_size, norm_by_std=norm_by_std)
    r = torch.as_tensor(rewards).double()
    check_1d("rewards", r)
    check_finite("rewards", r)
    check_groups(r.shape[0], group_size, need_pairs=True)
    r_gn = r.view(-1, group_size)
    centred = r_gn - r_gn.mean(-1, keepdim=True)
    if estimator == "rloo":
        return (centred * group_size / (group_size - 1)).reshape(-1).float()
    if response_lens is None:
        raise ValueError(f"the {estimator} estimator needs the response lengths")
    lens = torch.as_tensor(response_lens).double().view(-1, group_size)
    if estimator == "opo":
        baseline = (lens * r_gn).sum(-1, keepdim=True) / lens.sum(-1, keepdim=True)
        return (r_gn - baseline).reshape(-1).float()
    # reinforce_plus_plus_baseline: every token of response i carries centred_i; whiten over all the step's tokens
    x, w = centred.reshape(-1), lens.reshape(-1)
    num_tokens = w.sum()
    mean = (w * x).sum() / num_tokens
    var = (w * (x - mean) ** 2).sum() / num_tokens * num_tokens / (num_tokens - 1)
    return ((x - mean) * torch.rsqrt(var + WHITEN_EPS)).float()
