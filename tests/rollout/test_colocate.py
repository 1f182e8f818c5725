"""Colocated mode's orchestration, with a recording engine and a recording trainer state.

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
