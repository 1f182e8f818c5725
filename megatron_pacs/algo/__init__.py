"""PACS and GRPO as pure PyTorch (no torch.distributed, Megatron, Ray or vLLM): usable from any backend."""

from megatron_pacs.algo.grpo import grpo_advantages, grpo_loss
from megatron_pacs.algo.loss_contract import LossOutput
from megatron_pacs.algo.metrics import pacs_metrics, reduce_metrics, reduction_of
from megatron_pacs.algo.pacs import (
    ADVANTAGES,
    SCORES,
    WEIGHTS,
    compute_scores,
    group_advantages,
    group_weights,
    pacs_loss,
    pacs_score_grads,
    pacs_surrogate,
)
from megatron_pacs.algo.passk import pass_at_k, pass_at_k_curve, powers_of_two_up_to
from megatron_pacs.algo.tokens import masked_sequence_sum

__all__ = [
    "ADVANTAGES",
    "SCORES",
    "WEIGHTS",
    "LossOutput",
    "compute_scores",
    "group_advantages",
    "group_weights",
    "grpo_advantages",
    "grpo_loss",
    "masked_sequence_sum",
    "pacs_loss",
    "pacs_metrics",
    "pacs_score_grads",
    "pacs_surrogate",
    "pass_at_k",
    "pass_at_k_curve",
    "powers_of_two_up_to",
    "reduce_metrics",
    "reduction_of",
]
