"""Megatron's schedule as the one way to run the model: forward steps, micro-batches, per-sequence log-probs.

Sequences are right-padded token ids ``[N, L]`` with a mask ``[N, L]`` of the positions whose token is scored
(the response). The log-prob of token t comes from the logits at position t - 1, so position 0 is never scored.
Every micro-batch has the same shape ``[b, L]`` (pipeline stages exchange fixed-size activations).

Shapes: N sequences, L padded length, b micro-batch size, Vp = V / TP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs
from megatron_pacs.mcore.parallel import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "MicroBatch",
    "make_micro_batches",
    "model_token_logprobs",
    "run_schedule",
    "sequence_logprobs",
    "token_logprobs",
]

# (logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report): Megatron's 3-tuple loss convention.
LossFn = Callable[[torch.Tensor, "MicroBatch"], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class MicroBatch:
    """One micro-batch: ``tokens [b, L]``, ``score_mask [b, L]`` (True where a token is scored), ``index [b]``
    (positions in the full batch; -1 for padding rows)."""

    tokens: torch.Tensor
    score_mask: torch.Tensor
    index: torch.Tensor


def make_micro_batches(tokens: torch.Tensor, score_mask: torch.Tensor, micro_batch_size: int) -> list[MicroBatch]:
    """Split ``[N, L]`` into micro-batches of exactly ``micro_batch_size`` rows (the last padded with a copy of
    row 0 whose index is -1, so every pipeline message has one shape)."""
    if tokens.shape != score_mask.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and score_mask {tuple(score_mask.shape)} must be [N, L]")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    n = tokens.shape[0]
    out = []
    for s in range(0, n, micro_batch_size):
        idx = torch.arange(s, min(s + micro_batch_size, n))
        pad = micro_batch_size - idx.numel()
        rows = torch.cat([idx, idx.new_zeros(pad)])
        index = torch.cat([idx, idx.new_full((pad,), -1)])
        out.append(MicroBatch(tokens[rows], score_mask[rows].bool() & (index >= 0)[:, None], index))
    return out


def model_token_logprobs(
    output: torch.Tensor, mb: MicroBatch, tp_group: dist.ProcessGroup, temperature: float = 1.0
) -> torch.Tensor:
    """``[b, L - 1]`` log-prob of ``tokens[:, 1:]`` from the last stage's logits ``[b, L, Vp]``."""
    return vocab_parallel_logprobs(
        output[:, :-1], mb.tokens[:, 1:].to(output.device), tp_group, temperature=temperature
    )


def _forward_step_factory(loss_fn: LossFn):
    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        device = next(model.parameters()).device
        tokens = mb.tokens.to(device)
        length = tokens.shape[1]
        position_ids = torch.arange(length, device=device)[None].expand_as(tokens)
        # An explicit causal mask (True = masked): Megatron's default one is allocated on "cuda".
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]
        output = model(tokens, position_ids, causal)

        return output, lambda output_tensor: loss_fn(output_tensor, mb)

    return forward_step


def run_schedule(
    models: Sequence[MegatronModule],
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run Megatron's forward(-backward) schedule over ``micro_batches``.

    ``loss_fn(logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report)`` runs on the last stage, in
    Megatron's 3-tuple convention.

    Returns:
        On the last pipeline stage, the report dicts of ``loss_fn``, one per micro-batch; ``[]`` elsewhere.
    """
    seq_length = micro_batches[0].tokens.shape[1]
    mbs = micro_batches[0].tokens.shape[0]
    if len(models) > 1:  # interleaved: one iterator per model chunk
        data_iterator = [iter(micro_batches) for _ in models]
    else:
        data_iterator = iter(micro_batches)
    with cuda_to_cpu():
        return get_forward_backward_func()(
            forward_step_func=_forward_step_factory(loss_fn),
            data_iterator=data_iterator,
            model=list(models),
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )


def _token_logp_loss_fn(tp_group: dist.ProcessGroup, temperature: float) -> LossFn:
    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        token_logp = model_token_logprobs(logits, mb, tp_group, temperature)
        count = torch.tensor(token_logp.shape[0], dtype=torch.int, device=token_logp.device)
        return token_logp.sum(), count, {"token_logp": token_logp.detach(), "index": mb.index.to(token_logp.device)}

    return loss_fn


@torch.no_grad()
def token_logprobs(
    models: Sequence[MegatronModule],
    groups: ParallelGroups,
    tokens: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob of every token given its prefix, on every rank (forward-only schedule, any TP / PP / VPP).

    Args:
        models: This rank's model chunks.
        groups: Parallel groups.
        tokens: ``[N, L]`` right-padded token ids.
        micro_batch_size: Rows per micro-batch.
        temperature: The sampling temperature the log-probs refer to.

    Returns:
        ``[N, L - 1]`` float32: entry ``t`` is ``log p(tokens[:, t + 1] | tokens[:, :t + 1])``.
    """
    for m in models:
        m.eval()
    mask = torch.ones_like(tokens, dtype=torch.bool)
    micro_batches = make_micro_batches(tokens, mask, micro_batch_size)
    reports = run_schedule(models, micro_batches, _token_logp_loss_fn(groups.tp_group, temperature), forward_only=True)
    device = next(models[0].parameters()).device
    result = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.float32, device=device)
    if groups.is_last_stage:
        for r in reports:
            keep = r["index"] >= 0
            result[r["index"][keep]] = r["token_logp"][keep].float()
    if groups.pp_size > 1:
        dist.broadcast(result, src=groups.last_stage_global_rank, group=groups.pp_group)
    return result


def sequence_logprobs(
    models: Sequence[MegatronModule],
    groups: ParallelGroups,
    tokens: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-sequence sums of the scored tokens' log-probs, on every rank (arguments as :func:`token_logprobs`).

    Args:
        score_mask: ``[N, L]`` True at the tokens to score (response tokens; position 0 is never scored).

    Returns:
        ``[N]`` float32 sums, identical on all ranks of the model-parallel group.
    """
    if tokens.shape != score_mask.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and score_mask {tuple(score_mask.shape)} must match")
    logp = token_logprobs(models, groups, tokens, micro_batch_size=micro_batch_size, temperature=temperature)
    mask = score_mask[:, 1:].to(logp.device).bool()
    return torch.where(mask, logp, torch.zeros_like(logp)).sum(-1)
