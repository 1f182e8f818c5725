"""Rollouts: the engine protocols and their types, the backend registry, the vLLM backend and the Ray fleet.

Nothing is imported until asked for: ``from megatron_pacs.rollout import RolloutFleet`` imports Ray,
``VLLMEngine`` imports the vLLM backend's module (vLLM itself when an engine starts), the types import torch, and
:mod:`megatron_pacs.rollout.backends` imports nothing heavy (the config reads its names). So the trainer's non-zero
ranks, ``--help`` and the tests of the types stay light.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on demand by __getattr__ below
    from megatron_pacs.rollout.fleet import RolloutFleet
    from megatron_pacs.rollout.types import (
        FleetEngine,
        Prompt,
        Response,
        RolloutEngine,
        RolloutGroup,
        SamplingConfig,
    )
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

__all__ = [
    "FleetEngine",
    "Prompt",
    "Response",
    "RolloutEngine",
    "RolloutFleet",
    "RolloutGroup",
    "SamplingConfig",
    "VLLMEngine",
]

_TYPES = ("FleetEngine", "Prompt", "Response", "RolloutEngine", "RolloutGroup", "SamplingConfig")


def __getattr__(name: str):
    if name in _TYPES:
        from megatron_pacs.rollout import types

        return getattr(types, name)
    if name == "RolloutFleet":
        from megatron_pacs.rollout import fleet

        return getattr(fleet, name)
    if name == "VLLMEngine":
        from megatron_pacs.rollout.vllm_backend import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
