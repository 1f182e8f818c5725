"""Rollouts: the engine protocol and its types (light), the vLLM engine and the Ray fleet (imported on demand).

``from megatron_pacs.rollout import RolloutFleet`` imports Ray; ``VLLMEngine`` imports vLLM. Neither is imported
until asked for, so the trainer's non-zero ranks and the tests of the types stay light.
"""

from typing import TYPE_CHECKING

from megatron_pacs.rollout.types import Prompt, Response, RolloutEngine, RolloutGroup, SamplingConfig

if TYPE_CHECKING:  # imported on demand by __getattr__ below
    from megatron_pacs.rollout.engine import VLLMEngine
    from megatron_pacs.rollout.fleet import RolloutFleet

__all__ = ["Prompt", "Response", "RolloutEngine", "RolloutFleet", "RolloutGroup", "SamplingConfig", "VLLMEngine"]


def __getattr__(name: str):
    if name == "RolloutFleet":
        from megatron_pacs.rollout import fleet

        return getattr(fleet, name)
    if name == "VLLMEngine":
        from megatron_pacs.rollout.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
