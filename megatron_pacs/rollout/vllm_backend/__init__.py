"""The vLLM backend (``--rollout-backend vllm``), the only package that imports vLLM: the engine
(:mod:`.engine`, what the fleet and the trainer call), its workers' side of a weight update (:mod:`.worker`, the
extension vLLM loads into every worker) and the check of ``--rollout-engine-kwargs`` (:mod:`.engine_args`, standard
library only: the config runs it without torch or vLLM).

Nothing is imported until asked for, so the config's check of the engine arguments stays light.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on demand by __getattr__ below
    from megatron_pacs.rollout.vllm_backend.engine import VLLMEngine
    from megatron_pacs.rollout.vllm_backend.worker import (
        WeightSyncExtension,
        deferred_attention_check,
        vllm_features,
    )

__all__ = ["VLLMEngine", "WeightSyncExtension", "deferred_attention_check", "vllm_features"]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from megatron_pacs.rollout.vllm_backend.engine import VLLMEngine

        return VLLMEngine
    if name in ("WeightSyncExtension", "deferred_attention_check", "vllm_features"):
        from megatron_pacs.rollout.vllm_backend import worker

        return getattr(worker, name)
    raise AttributeError(name)
