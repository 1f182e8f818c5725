"""The Megatron actor: log-probs of rollouts, and PACS / GRPO updates through Megatron's forward-backward schedule.

Losses follow Megatron's 3-tuple contract ``(loss_sum, count, report)`` with ``count`` = real responses in the
micro-batch; ``build_trainable`` builds the model with ``calculate_per_token_loss`` so the gradient is
``sum over the global mini-batch / global response count`` (derivation in :mod:`megatron_pacs.mcore.optim`),
independent of micro-batching, DP size and pipeline schedule.

PACS runs in one of two modes (spec Part A item 5):

- two-phase (default): the caller computes the closed-form ``c_i = dL/ds_i`` per group from phase-1 scores, and
  the loss back-propagates the surrogate ``sum_i c_i * s_i(theta)``; micro-batches may split groups.
- direct (``--keep-groups-in-microbatch``): whole groups per micro-batch, ``pacs_loss`` with autograd.

Legend: b rows per micro-batch, L padded length, Vp vocabulary shard, S responses of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.grpo import grpo_loss
from megatron_pacs.algo.pacs import compute_scores, pacs_loss, pacs_surrogate
from megatron_pacs.mcore.forward import MicroBatch, model_token_logprobs, run_schedule
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.optim import OptimConfig, StepResult, build_trainable, train_step
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights

__all__ = ["Actor", "LossSpec"]


@dataclass(kw_only=True)
class LossSpec:
    """Everything a training loss needs besides the logits, indexed by response index (``[S]`` tensors)."""

    kind: str
    """``pacs_two_phase``, ``pacs_direct`` or ``grpo``."""
    rewards: torch.Tensor
    response_lens: torch.Tensor
    group_size: int
    beta: float = 1.0
    score: str = "log_ratio"
    advantage: str = "rloo"
    weights: str = "balanced"
    old_seq_logp: torch.Tensor | None = None
    """``[S]`` rollout-policy sequence log-probs (log_ratio scores)."""
    coeffs: torch.Tensor | None = None
    """``[S]`` two-phase coefficients dL/ds (summed, not divided by the count: Megatron divides globally)."""
    old_token_logp: dict[int, torch.Tensor] | None = None
    """GRPO: response index -> ``[L_i - 1]`` rollout-policy token log-probs; None = the current policy (exact when
    the parameters have not moved since the rollout)."""
    advantages: torch.Tensor | None = None
    """GRPO: ``[S]`` group-normalised advantages."""
    max_response_len: int = 1
    clip_ratio: float = 0.2
    temperature: float = 1.0


class Actor:
    """This rank's model chunks with their optimizer, built from a Hugging Face directory.

    Args:
        hf_dir: Model directory (config + safetensors); the weights are loaded exactly.
        groups: Parallel groups.
        optim: Optimizer settings.
        dtype: Parameter dtype.
        recompute: Full activation recompute.
        spec: Layer implementation (``auto``, ``te``, ``sdpa``, ``local``).
        fp8: Transformer Engine FP8 settings for ``TransformerConfig`` (``fp8``, ``fp8_recipe``) or None.
        trainable: False builds a frozen model (a reference policy) without DDP or optimizer.
    """

    def __init__(
        self,
        hf_dir: str,
        groups: ParallelGroups,
        optim: OptimConfig | None,
        *,
        dtype: torch.dtype = torch.float32,
        recompute: bool = False,
        spec: str = "auto",
        fp8: dict[str, Any] | None = None,
        trainable: bool = True,
    ) -> None:
        from transformers import AutoConfig

        self.groups = groups
        self.hf_config = AutoConfig.from_pretrained(hf_dir)
        self.models = build_gpt_model(self.hf_config, groups, dtype=dtype, recompute=recompute, spec=spec,
                                      calculate_per_token_loss=True, **(fp8 or {}))  # fmt: skip
        load_hf_weights(self.models, hf_dir, groups, self.hf_config)
        self.ddp_models, self.optimizer = None, None
        if trainable:
            if optim is None:
                raise ValueError("a trainable Actor needs an OptimConfig")
            self.ddp_models, self.optimizer = build_trainable(self.models, groups, optim)
        else:
            for p in (p for m in self.models for p in m.parameters()):
                p.requires_grad_(False)

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return self.ddp_models if self.ddp_models is not None else self.models

    # -- forward-only ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self, micro_batches: list[MicroBatch], num_responses: int, *, temperature: float = 1.0, tokens: bool = False
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Sequence (and optionally token) log-probs of the micro-batches' responses, on every rank.

        Returns:
            ``(seq_logp [S], token_logp)``: ``seq_logp[i]`` is the masked sum for response i (0 for responses not
            in the micro-batches); ``token_logp`` maps i to its ``[L_i - 1]`` token log-probs when ``tokens``.
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
        return seq_logp, token_logp

    # -- training ----------------------------------------------------------------------------------------------

    def train(self, micro_batches: list[MicroBatch], spec: LossSpec, *, inject_nan: bool = False) -> StepResult:
        """One optimizer step over this rank's micro-batches of a mini-batch (collective over all ranks)."""
        assert self.ddp_models is not None and self.optimizer is not None, "a frozen Actor cannot train"
        loss_fn = make_loss_fn(spec, self.groups.tp_group)
        return train_step(self.ddp_models, self.optimizer, self.groups, micro_batches, loss_fn,
                          inject_nan=inject_nan)  # fmt: skip

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the current weights under HF names (every rank must iterate to the end)."""
        return export_hf_weights(self.models, self.groups, self.hf_config)


def _real(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    keep = mb.index >= 0
    return keep, mb.index[keep]


def make_loss_fn(spec: LossSpec, tp_group: dist.ProcessGroup) -> Callable:
    """The last stage's ``loss_fn(logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report)``."""

    def token_logp(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logp = model_token_logprobs(logits, mb, tp_group, spec.temperature)
        mask = mb.score_mask[:, 1:].to(logp.device)
        return logp, mask

    def pacs_two_phase(logits, mb):
        logp, mask = token_logp(logits, mb)
        keep, idx = _real(mb)
        seq = torch.where(mask, logp, 0.0).sum(-1)[keep.to(logp.device)].float()
        old = None if spec.old_seq_logp is None else spec.old_seq_logp[idx].to(seq.device)
        s = compute_scores(seq, old, beta=spec.beta, score=spec.score, response_lens=spec.response_lens[idx])
        surrogate = pacs_surrogate(s, spec.coeffs[idx].to(s.device))
        return surrogate, torch.tensor(int(idx.numel()), dtype=torch.int), {}

    def pacs_direct(logits, mb):
        logp, mask = token_logp(logits, mb)
        keep, idx = _real(mb)
        seq = torch.where(mask, logp, 0.0).sum(-1)[keep.to(logp.device)].float()
        # No old log-probs means the parameters have not moved since the rollout: l_old = l, exactly.
        old = seq.detach() if spec.old_seq_logp is None else spec.old_seq_logp[idx].to(seq.device)
        out = pacs_loss(seq, old, spec.rewards[idx].to(seq.device), group_size=spec.group_size, beta=spec.beta,
                        score=spec.score, advantage=spec.advantage, weights=spec.weights,
                        response_lens=spec.response_lens[idx])  # fmt: skip
        return out.loss_sum, torch.tensor(out.count, dtype=torch.int), out.metrics

    def grpo(logits, mb):
        logp, mask = token_logp(logits, mb)
        keep, idx = _real(mb)
        keep = keep.to(logp.device)
        logp, mask = logp[keep], mask[keep]
        if spec.old_token_logp is None:
            old = logp.detach()
        else:
            old = torch.zeros_like(logp)
            for j, i in enumerate(idx.tolist()):
                t = spec.old_token_logp[i].to(old.device)
                n = min(t.numel(), old.shape[1])
                old[j, :n] = t[:n]
        out = grpo_loss(logp, old, mask, spec.advantages[idx].to(logp.device), max_response_len=spec.max_response_len,
                        clip_ratio=spec.clip_ratio, rewards=spec.rewards[idx].to(logp.device))  # fmt: skip
        return out.loss_sum, torch.tensor(out.count, dtype=torch.int), out.metrics

    fns = {"pacs_two_phase": pacs_two_phase, "pacs_direct": pacs_direct, "grpo": grpo}
    if spec.kind not in fns:
        raise ValueError(f"LossSpec.kind={spec.kind!r} is not one of {list(fns)}")
    return fns[spec.kind]
