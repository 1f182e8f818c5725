"""Colocated mode (``--colocate``, GPU only): the engines and the actor share the GPUs, taking turns.

Around each update, in this order (docs/architecture.md §4.1):

1. the engines sleep at level 2: they drop their KV cache and their weights (new weights arrive after the update
   anyway, so keeping a host copy, level 1, would only cost host memory and a copy);
2. with ``--offload-optimizer-during-rollout`` the actor brings its optimizer state and gradient buffers back to
   the GPU;
3. the update runs;
4. the actor moves the optimizer state and gradient buffers to host memory again;
5. the engines reallocate their weights' memory (``wake_up(["weights"])``), the new weights arrive (CUDA IPC on
   the same GPU, the ``ipc`` transport), and only then the KV cache (``wake_up(["kv_cache"])``), so the cache can
   use what the trainer just freed.

Everything here goes through the :class:`~megatron_pacs.rollout.types.RolloutEngine` protocol and a two-method
trainer hook, so the order is tested on a CPU with recording stand-ins (vLLM's sleep mode needs CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from megatron_pacs.rollout.types import RolloutEngine

__all__ = ["Colocation", "TrainingState"]


class TrainingState(Protocol):
    """What the actor moves off the GPU while the engines generate."""

    def offload_training_state(self) -> None:
        """Optimizer state and gradient buffers to host memory."""
        ...

    def onload_training_state(self) -> None:
        """Back to the GPU before the update."""
        ...


class Colocation:
    """The colocated cycle around each update (see the module docstring).

    Args:
        engine: The fleet (on the driver; None on the other ranks, which only move their own training state).
        state: The actor, when ``--offload-optimizer-during-rollout``; else None.
    """

    def __init__(self, engine: RolloutEngine | None, state: TrainingState | None) -> None:
        self.engine, self.state = engine, state

    def start(self) -> None:
        """Before the first generation: the engines own the GPU memory the trainer does not need."""
        if self.state is not None:
            self.state.offload_training_state()

    def before_train(self) -> None:
        if self.engine is not None:
            self.engine.sleep(level=2)
        if self.state is not None:
            self.state.onload_training_state()

    def after_train(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Free the trainer's memory, wake the engines' weights, sync them (collective), then the KV cache."""
        if self.state is not None:
            self.state.offload_training_state()
        if self.engine is not None:
            self.engine.wake_up(tags=["weights"])
        stats = sync()
        if self.engine is not None:
            self.engine.wake_up(tags=["kv_cache"])
        return stats
