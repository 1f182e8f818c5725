"""The frozen reference policy pi_ref: the KL term's and PACS v2's anchor (docs/algorithm.md §2.2, §2.7).

A Megatron model with the actor's TP/PP layout and dtype, loaded from ``--ref-load`` (default: the actor's initial
``--hf-model``), never trained: no DDP wrapper, no optimizer, no gradients. When a step needs the actor's old
log-probs too, both models run in one forward-only schedule over the same micro-batches (``policy_logprobs``: one
schedule, two models). A reset (``--ref-reset-interval``) copies the actor's current weights into it in memory,
each rank its own shards (the layouts are the same, so shard i of the actor is shard i of the reference). With
``--ref-offload`` the weights stay in pinned host memory between uses and are copied to the GPU around each
forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from megatron_pacs.algo.objectives import Logprobs
from megatron_pacs.algo.tokens import MicroBatch
from megatron_pacs.config import ModelConfig, ReferenceConfig
from megatron_pacs.mcore.actor import Actor, policy_logprobs
from megatron_pacs.mcore.optim import reset_optimizer_state
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.utils.logging import get_logger

__all__ = ["ReferencePolicy"]

log = get_logger("reference")


class ReferencePolicy:
    """The frozen reference policy (see the module docstring).

    Args:
        model: The actor's model settings (dtype, FP8, layer implementation); the weights come from ``load``.
        groups: The actor's parallel groups.
        load: HF directory of the reference weights (None: ``model.hf_model``).
        offload: Keep the weights in pinned host memory between uses (CUDA only).
    """

    def __init__(self, model: ModelConfig, groups: ParallelGroups, *, load: str | None, offload: bool) -> None:
        if offload and not torch.cuda.is_available():
            raise ValueError("--ref-offload: needs CUDA (the reference then waits in pinned host memory)")
        self.policy = Actor(replace(model, hf_model=load or model.hf_model), groups, None)
        self.offload = offload
        self.resets = 0
        #: The reference's weights are the actor's exactly (built from the same weights, or reset and no update
        #: since): the step then takes the first mini-batch's reference-anchored scores and KL as 0 exactly. The
        #: step clears it on its first update; a resume restores it from the checkpoint.
        self.equals_actor = load is None or load == model.hf_model
        self.seconds_onload = 0.0
        self._host: list[torch.Tensor] = []
        if offload:
            self._host = [t.detach().cpu().pin_memory() for t in self._tensors()]
            self._to_host()

    @property
    def models(self):
        """The reference's model chunks (for checkpoints)."""
        return self.policy.models

    def _tensors(self) -> Iterator[torch.Tensor]:
        for m in self.policy.models:
            yield from m.parameters()
            yield from (b for b in m.buffers() if b is not None)

    def _to_host(self) -> None:
        for t, host in zip(self._tensors(), self._host, strict=True):
            t.data = host

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        if not self.offload:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        device = torch.device("cuda", torch.cuda.current_device())
        for t, host in zip(self._tensors(), self._host, strict=True):
            t.data = host.to(device, non_blocking=True)
        end.record()
        try:
            yield
        finally:
            end.synchronize()
            self.seconds_onload += start.elapsed_time(end) / 1e3
            self._to_host()

    def logprobs(
        self,
        micro_batches: list[MicroBatch],
        response_lens: torch.Tensor,
        *,
        temperature: float,
        tokens: bool,
        fp8: bool = True,
        actor: Actor | None = None,
        actor_tokens: bool = False,
    ) -> tuple[Logprobs, Logprobs | None]:
        """The reference's log-probs of the micro-batches' responses (as :meth:`Actor.logprobs`) and, with
        ``actor``, the actor's too, from the same forward-only schedule (one pipeline fill and drain, one pass over
        the micro-batches; ``actor_tokens`` as ``tokens``).

        Returns:
            ``(reference, actor)`` log-probs; ``actor`` is None when no actor was given.
        """
        policies = [self.policy] if actor is None else [self.policy, actor]
        with self._on_device():
            out = policy_logprobs(
                policies,
                micro_batches,
                response_lens,
                temperature=temperature,
                tokens=[tokens, actor_tokens][: len(policies)],
                fp8=fp8,
            )
        return out[0], (out[1] if actor is not None else None)

    @torch.no_grad()
    def reset_from(self, actor: Actor) -> None:
        """Make the reference an exact copy of ``actor``'s current weights (collective-free: shard to shard)."""
        ours = [t for m in self.policy.models for t in m.parameters()]
        theirs = [t for m in actor.models for t in m.parameters()]
        if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
            raise ValueError("the reference and the actor must have the same architecture and parallel layout")
        for dst, src in zip(ours, theirs, strict=True):
            dst.data.copy_(src.data)  # pinned host copies when offloaded (dst.data is the host tensor then)
        self.resets += 1
        self.equals_actor = True

    def after_step(self, step: int, actor: Actor, cfg: ReferenceConfig) -> dict[str, float]:
        """At the end of every ``--ref-reset-interval``-th step: reference <- ``actor``'s weights, and Adam's state
        reset (``--ref-reset-optimizer``, with ``--ref-reset-lr-warmup-steps``). Returns the step's ``ref/``
        metrics (and the offloaded reference's copy time)."""
        every = cfg.ref_reset_interval
        if every and step % every == 0:
            self.reset_from(actor)
            if cfg.ref_reset_optimizer:
                assert actor.trainable is not None, "a reset's actor is the trained one"
                reset_optimizer_state(actor.trainable, cfg.ref_reset_lr_warmup_steps)
            log.info("step %d: reference reset to the current policy (reset #%d)", step, self.resets)
        out = {"ref/resets": float(self.resets)}
        if self.offload:
            out["perf/time/ref_onload"], self.seconds_onload = self.seconds_onload, 0.0
        return out
