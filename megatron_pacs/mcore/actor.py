"""The Megatron actor: log-probs of rollouts, and updates through Megatron's forward-backward schedule.

The actor knows nothing of the objective: :meth:`Actor.train` takes a micro-batch loss from
:mod:`megatron_pacs.algo.objectives` (token log-probs in, Megatron's ``(loss_sum, count, report)`` out) and wraps it
with the vocab-parallel log-probs of the last stage's logits. The model is built with ``calculate_per_token_loss``,
so the gradient is ``sum over the global mini-batch / global count`` (docs/algorithm.md §4), independent of
micro-batching, DP size and pipeline schedule.

Legend: b rows per micro-batch, L padded length, Vp vocabulary shard, S responses of the step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_pacs.algo.objectives import Logprobs, MicroBatchLoss
from megatron_pacs.config import ModelConfig, OptimConfig
from megatron_pacs.mcore.forward import MicroBatch, model_token_logprobs, run_schedule
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.optim import StepResult, Trainable, build_trainable, train_step
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = ["Actor"]


class Actor:
    """This rank's model chunks, built from ``model.hf_model`` (weights loaded exactly), with their optimizer.

    Args:
        model: The model settings (HF directory, dtype, FP8, recompute, layer implementation).
        groups: Parallel groups.
        optim: Optimizer settings; None builds a frozen model (a reference policy) without DDP or optimizer.
    """

    def __init__(self, model: ModelConfig, groups: ParallelGroups, optim: OptimConfig | None) -> None:
        from transformers import AutoConfig

        self.groups = groups
        self.hf_config = AutoConfig.from_pretrained(model.hf_model)
        dtype = torch.bfloat16 if model.bf16 else torch.float32
        self.models = build_gpt_model(
            self.hf_config,
            groups,
            dtype=dtype,
            recompute=model.recompute_activations,
            spec=model.transformer_impl,
            calculate_per_token_loss=True,
            **(model.fp8 or {}),
        )
        load_hf_weights(self.models, model.hf_model, groups, self.hf_config)
        self.trainable: Trainable | None = None
        if optim is not None:
            self.trainable = build_trainable(self.models, groups, optim)
        else:
            for p in (p for m in self.models for p in m.parameters()):
                p.requires_grad_(False)

    @property
    def chunks(self) -> Sequence[MegatronModule]:
        return list(self.trainable.models) if self.trainable is not None else self.models

    # -- forward-only ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self, micro_batches: list[MicroBatch], num_responses: int, *, temperature: float = 1.0, tokens: bool = False
    ) -> Logprobs:
        """Sequence (and optionally token) log-probs of the micro-batches' responses, on every rank.

        Returns:
            ``Logprobs(seq [S], tokens)``: ``seq[i]`` is the masked sum for response i (0 for responses not in the
            micro-batches); ``tokens`` maps i to its ``[L_i - 1]`` token log-probs when asked for (last stage).
        """
        for m in self.chunks:
            m.eval()
        tp_group = self.groups.tp_group

        def loss_fn(logits: torch.Tensor, mb: MicroBatch):
            logp = model_token_logprobs(logits, mb, tp_group, temperature).float()
            seq = torch.where(mb.score_mask[:, 1:].to(logp.device), logp, 0.0).sum(-1)
            report = {"seq": seq, "index": mb.index.to(logp.device)}
            if tokens:
                report["tok"] = logp
            return seq.sum(), torch.tensor(1, dtype=torch.int), report

        reports = run_schedule(self.chunks, micro_batches, loss_fn, forward_only=True)
        device = next(self.models[0].parameters()).device
        seq_logp = torch.zeros(num_responses, dtype=torch.float32, device=device)
        token_logp: dict[int, torch.Tensor] = {}
        for r in reports:
            keep = r["index"] >= 0
            seq_logp[r["index"][keep]] = r["seq"][keep]
            if tokens:
                for j in keep.nonzero().flatten().tolist():
                    token_logp[int(r["index"][j])] = r["tok"][j]
        if self.groups.pp_size > 1:
            dist.broadcast(seq_logp, src=self.groups.last_stage_global_rank, group=self.groups.pp_group)
        return Logprobs(seq_logp, token_logp if tokens else None)

    # -- training ----------------------------------------------------------------------------------------------

    def train(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss, *, temperature: float = 1.0) -> StepResult:
        """One optimizer step over this rank's micro-batches of a mini-batch (collective over all ranks).

        Args:
            micro_batches: This rank's share of the mini-batch.
            loss: An objective's micro-batch loss (:class:`megatron_pacs.algo.objectives.Prepared`).
            temperature: The sampling temperature the log-probs refer to.
        """
        if self.trainable is None:
            raise ValueError("this Actor is frozen (built without an OptimConfig) and cannot train")
        tp_group = self.groups.tp_group

        def loss_fn(logits: torch.Tensor, mb: MicroBatch):
            logp = model_token_logprobs(logits, mb, tp_group, temperature)
            return loss(logp, mb.score_mask[:, 1:].to(logp.device), mb.index)

        return train_step(self.trainable, micro_batches, loss_fn)

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the current weights under HF names (every rank must iterate to the end)."""
        return export_hf_weights(self.models, self.groups, self.hf_config)
