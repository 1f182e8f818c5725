"""Colocated mode's orchestration, with a recording engine, a recording trainer state and (for the memory
hand-over) simulated torch.cuda allocator counters.

vLLM's sleep mode needs CUDA, so on this machine the order of the calls is what is tested, through the
RolloutEngine protocol the real fleet implements: generate -> sleep(level 2) -> onload -> update -> offload ->
wake the weights -> sync -> wake the KV cache -> generate. The GPU checks (memory actually released, CUDA IPC
weight transfer) are listed in docs/architecture.md §4.1.
"""

from collections.abc import Iterable

import torch

from megatron_pacs.rollout.colocate import Colocation
from megatron_pacs.rollout.types import RolloutEngine


class RecordingEngine:
    """A RolloutEngine stand-in that records the calls (a recording engine, not vLLM)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def generate(self, prompts, sampling):
        self.calls.append("generate")
        return []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        self.calls.append(f"update_weights({sum(1 for _ in named_tensors)})")
        return {"sync/seconds": 0.0}

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class RecordingState:
    """The actor's training-state hooks, recorded."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def offload_training_state(self) -> None:
        self.calls.append("offload")

    def onload_training_state(self) -> None:
        self.calls.append("onload")


def _two_steps(colocation: Colocation, engine: RecordingEngine | None, calls: list[str]) -> None:
    weights = [("w", torch.zeros(1)), ("b", torch.zeros(1))]

    def sync() -> dict[str, float]:
        return engine.update_weights(weights) if engine is not None else {}

    colocation.start()
    for _ in range(2):
        if engine is not None:
            engine.generate([], None)
        colocation.before_train()
        calls.append("train")
        colocation.after_train(sync)


def test_colocated_cycle_order_with_a_recording_engine():
    calls: list[str] = []
    engine = RecordingEngine(calls)
    assert isinstance(engine, RolloutEngine)  # the protocol the real fleet satisfies
    _two_steps(Colocation(engine, RecordingState(calls)), engine, calls)
    cycle = [
        "generate",
        "sleep(2)",  # KV cache and weights dropped: new weights arrive after the update anyway
        "onload",  # optimizer state and gradient buffers back on the GPU
        "train",
        "offload",  # ... and off again, before the engines take the memory back
        "wake_up(['weights'])",
        "update_weights(2)",  # the new weights land in the reallocated weight memory (CUDA IPC on GPU)
        "wake_up(['kv_cache'])",  # the cache last, so it can use what the trainer freed
    ]
    assert calls == ["offload", *cycle, *cycle]


def test_without_offloading_and_on_a_rank_without_the_fleet_only_the_right_calls_happen():
    calls: list[str] = []
    engine = RecordingEngine(calls)
    _two_steps(Colocation(engine, None), engine, calls)
    assert "offload" not in calls and "onload" not in calls
    assert calls[:6] == [
        "generate",
        "sleep(2)",
        "train",
        "wake_up(['weights'])",
        "update_weights(2)",
        "wake_up(['kv_cache'])",
    ]
    others: list[str] = []
    _two_steps(Colocation(None, RecordingState(others)), None, others)  # a non-driver rank: its state only
    assert others == ["offload", "onload", "train", "offload", "onload", "train", "offload"]


class SimulatedCudaAllocator:
    """torch.cuda's allocator counters, simulated (no CUDA here): ``offload`` moves ``state_gb`` into the cache, as
    a tensor freed to PyTorch's caching allocator does, and ``empty_cache`` returns the cache to the GPU."""

    def __init__(self, monkeypatch, calls: list[str], used_gb: float, cached_gb: float) -> None:
        self.calls, self.used, self.cached = calls, used_gb, cached_gb
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int((self.used + self.cached) * 2**30))
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0.0

    def offload(self, gb: float) -> None:
        self.used, self.cached = self.used - gb, self.cached + gb


def test_after_the_update_the_cache_is_emptied_before_the_engines_wake_and_freed_memory_reported_simulated_cuda(
    monkeypatch,
):
    """Simulated torch.cuda counters (no GPU here): without --offload-optimizer-during-rollout the cached
    activations alone are given back; with it, the offloaded state too. Emptying comes before the
    weights wake up."""
    calls: list[str] = []
    engine = RecordingEngine(calls)
    gpu = SimulatedCudaAllocator(monkeypatch, calls, used_gb=10.0, cached_gb=0.0)
    colocation = Colocation(engine, None)
    colocation.before_train()
    gpu.cached = 3.0  # the update's activations and logits, freed into PyTorch's cache
    stats = colocation.after_train(lambda: {"sync/seconds": 1.0})
    assert stats == {"sync/seconds": 1.0, "colocate/freed_gb": 3.0}
    assert calls == ["sleep(2)", "empty_cache", "wake_up(['weights'])", "wake_up(['kv_cache'])"]

    class OffloadingState(RecordingState):
        def offload_training_state(self) -> None:
            super().offload_training_state()
            gpu.offload(4.0)

    calls.clear()
    colocation = Colocation(engine, OffloadingState(calls))
    colocation.before_train()
    gpu.cached = 1.0
    stats = colocation.after_train(lambda: {})
    assert stats == {"colocate/freed_gb": 5.0}
    assert calls == ["sleep(2)", "onload", "offload", "empty_cache", "wake_up(['weights'])", "wake_up(['kv_cache'])"]


def test_start_frees_the_gpu_before_any_engine_exists_simulated_cuda(monkeypatch):
    """Simulated torch.cuda counters: Colocation.start (which the trainer runs before it starts the fleet, issue
    23.4) offloads the state and empties the cache with no engine attached yet."""
    calls: list[str] = []
    gpu = SimulatedCudaAllocator(monkeypatch, calls, used_gb=10.0, cached_gb=2.0)

    class OffloadingState(RecordingState):
        def offload_training_state(self) -> None:
            super().offload_training_state()
            gpu.offload(6.0)

    Colocation(None, OffloadingState(calls)).start()
    assert calls == ["offload", "empty_cache"] and gpu.used + gpu.cached == 4.0


def test_a_colocated_resume_loads_between_sleep_and_wake_and_always_syncs():
    """Trainer._resume_and_sync with recording stand-ins: the checkpoint loads into the training state on the GPU
    while the engines sleep; the engines then wake with the loaded weights (synced even when there was no
    checkpoint: a level-2 sleep dropped the engines' weights). Without colocation, a fresh start syncs nothing."""
    from types import SimpleNamespace

    from megatron_pacs.trainer import Trainer

    def resume_and_sync(colocated: bool, found: int) -> list[str]:
        calls: list[str] = []
        engine = RecordingEngine(calls)
        trainer = SimpleNamespace(
            colocation=Colocation(engine, RecordingState(calls)) if colocated else None,
            resume=lambda loader: calls.append("load") or found,
            sync_weights=lambda: engine.update_weights([("w", torch.zeros(1))]),
        )
        assert Trainer._resume_and_sync(trainer, loader=None) == found  # type: ignore[arg-type]
        return calls

    colocated = [
        "sleep(2)",
        "onload",
        "load",
        "offload",
        "wake_up(['weights'])",
        "update_weights(1)",
        "wake_up(['kv_cache'])",
    ]
    assert resume_and_sync(True, found=2) == resume_and_sync(True, found=0) == colocated
    assert resume_and_sync(False, found=2) == ["load", "update_weights(1)"]
    assert resume_and_sync(False, found=0) == ["load"]


def test_the_actor_and_the_critic_move_together():
    """PPO: the critic's training state leaves the GPU and comes back with the actor's, around the same update."""
    from megatron_pacs.rollout.colocate import TrainingStates

    calls: list[str] = []

    class Named(RecordingState):
        def __init__(self, name: str) -> None:
            super().__init__(calls)
            self.name = name

        def offload_training_state(self) -> None:
            calls.append(f"offload {self.name}")

        def onload_training_state(self) -> None:
            calls.append(f"onload {self.name}")

    engine = RecordingEngine(calls)
    colocation = Colocation(engine, TrainingStates(Named("actor"), Named("critic")))
    colocation.before_train()
    colocation.after_train(lambda: {})
    assert calls == [
        "sleep(2)",
        "onload actor",
        "onload critic",
        "offload actor",
        "offload critic",
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
    ]
