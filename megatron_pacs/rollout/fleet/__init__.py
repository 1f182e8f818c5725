"""The Ray-managed engine fleet: N engine actors behind one :class:`RolloutEngine`; the only package importing Ray.

- Start: connects to a Ray cluster (``ray_address``) or starts a local one whose temp folder lives in the run
  directory; one actor per engine, each holding an engine of the ``--rollout-backend`` (vLLM:
  :class:`~megatron_pacs.rollout.vllm_backend.VLLMEngine`), called through
  :class:`~megatron_pacs.rollout.types.FleetEngine` (GPU: a placement group with ``tensor_parallel_size`` GPUs per
  engine; CPU: one in-process engine per actor).
- Generate: prompts are cut into chunks balanced by expected tokens (longest first onto the lightest chunk), and
  idle engines pull the next chunk, so a slow engine does not hold the step. Results come back in prompt order.
- Failures: every engine call (a generation chunk, a weight bucket, a probe, sleep, wake-up) goes through one
  path: an engine that dies, or does not answer within ``--engine-call-timeout-seconds``, is killed, its placement
  group removed, and a new one started, re-synced to the latest weights (when a host copy of the last update is
  kept, ``--keep-weights-for-restart``) and only then given work; its unfinished part of the call runs again.
- Weights: ``update_weights`` streams HF-named tensors in buckets through the object store (CPU), a broadcast
  side group (NCCL between trainer and engines on GPU; gloo here), or CUDA IPC (colocated, GPU only).
"""

from megatron_pacs.rollout.fleet.engines import EngineActor, EngineSet
from megatron_pacs.rollout.fleet.fleet import RolloutFleet

__all__ = ["EngineActor", "EngineSet", "RolloutFleet"]
