"""The vLLM backend (``--rollout-backend vllm``), the only package that imports vLLM: the engine
(:mod:`.engine`, what the fleet and the trainer call) and its workers' side of a weight update (:mod:`.worker`, the
extension vLLM loads into every worker).
"""

from megatron_pacs.rollout.vllm_backend.engine import VLLMEngine
from megatron_pacs.rollout.vllm_backend.worker import WeightSyncExtension, deferred_attention_check, vllm_features

__all__ = ["VLLMEngine", "WeightSyncExtension", "deferred_attention_check", "vllm_features"]
