"""Colocated mode (``--colocate``, GPU only): the engines and the actor share the GPUs, taking turns.

Around each update, in this order (docs/architecture.md §4.1):

1. the engines sleep at level 2: they drop their KV cache and their weights (new weights arrive after the update
   anyway, so keeping a host copy, level 1, would only cost host memory and a copy);
2. with ``--offload-optimizer-during-rollout`` the actor brings its optimizer state and gradient buffers back to
   the GPU;
3. the update runs;
4. the actor moves the optimizer state and gradient buffers to host memory again, and the trainer's allocator
   returns its cached blocks (activations, logits) to the GPU (``gc.collect()``, ``torch.cuda.empty_cache()``;
   the amount is the ``colocate/freed_gb`` metric);
5. the engines reallocate their weights' memory (``wake_up(["weights"])``), the new weights arrive (CUDA IPC on
   the same GPU, the ``ipc`` transport), and only then the KV cache (``wake_up(["kv_cache"])``), so the cache can
   use what the trainer just freed.

Everything here goes through the :class:`~megatron_pacs.rollout.types.RolloutEngine` protocol and a two-method
trainer hook, so the order is tested on a CPU with recording stand-ins (vLLM's sleep mode needs CUDA).

The first offload (:meth:`Colocation.start`) runs before the engines exist: vLLM's start-up check wants
``--gpu-memory-utilization`` of the GPU free, so the trainer gives back what it can first (the trainer then attaches
the fleet, :attr:`Colocation.engine`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_pacs.rollout.types import RolloutEngine
from megatron_pacs.utils.logging import get_logger

__all__ = ["Colocation", "TrainingState", "TrainingStates", "release_cached_memory"]

log = get_logger("rollout.colocate")
GB = 1024**3


def _reserved_gb() -> float:
    """GiB that PyTorch's CUDA allocator holds on this rank's GPU (0 without CUDA)."""
    return torch.cuda.memory_reserved() / GB if torch.cuda.is_available() else 0.0


def release_cached_memory() -> None:
    """Return the blocks PyTorch's CUDA allocator caches (freed activations, logits, offloaded state) to the GPU,
    so an engine on the same GPU can take them; a no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    gc.collect()  # tensors kept alive only by reference cycles (autograd graphs, closures) are freed first
    torch.cuda.empty_cache()


class TrainingState(Protocol):
    """What the actor moves off the GPU while the engines generate."""

    def offload_training_state(self) -> None:
        """Optimizer state and gradient buffers to host memory."""
        ...

    def onload_training_state(self) -> None:
        """Back to the GPU before the update."""
        ...


class TrainingStates:
    """Several models' training states moved together (PPO: the actor's and the critic's), in order."""

    def __init__(self, *states: TrainingState) -> None:
        self.states = states

    def offload_training_state(self) -> None:
        for state in self.states:
            state.offload_training_state()

    def onload_training_state(self) -> None:
        for state in self.states:
            state.onload_training_state()


class Colocation:
    """The colocated cycle around each update (see the module docstring).

    Args:
        engine: The fleet (on the driver; None on the other ranks, which only move their own training state, and
            None until the trainer attaches it after :meth:`start`).
        state: The actor (with PPO's critic: both, :class:`TrainingStates`), when
            ``--offload-optimizer-during-rollout``; else None.
    """

    def __init__(self, engine: RolloutEngine | None, state: TrainingState | None) -> None:
        self.engine, self.state = engine, state

    def start(self) -> None:
        """Before the engines start: they own the GPU memory the trainer does not need from then on."""
        freed, reserved = self._free()
        if reserved:
            log.info("colocated: the trainer gave back %.2f of its %.2f GiB before the engines start", freed, reserved)

    def _free(self) -> tuple[float, float]:
        """Offload the training state (with the flag) and empty the allocator's cache; returns (GiB freed, GiB
        held before)."""
        before = _reserved_gb()
        if self.state is not None:
            self.state.offload_training_state()
        release_cached_memory()
        return max(before - _reserved_gb(), 0.0), before

    def before_train(self) -> None:
        if self.engine is not None:
            self.engine.sleep(level=2)
        if self.state is not None:
            self.state.onload_training_state()

    def after_train(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Free the trainer's memory, wake the engines' weights, sync them (collective), then the KV cache.

        Returns:
            ``sync()``'s metrics and ``colocate/freed_gb`` (what the trainer's allocator gave back to the GPU).
        """
        freed, _ = self._free()
        if self.engine is not None:
            self.engine.wake_up(tags=["weights"])
        stats = sync()
        if self.engine is not None:
            self.engine.wake_up(tags=["kv_cache"])
        return {**stats, "colocate/freed_gb": freed}
