"""The worker side of the vLLM backend: :class:`WeightSyncExtension`, the mixin vLLM adds to every worker (named
by ``worker_extension_cls``), and the repairs a weight reload needs.

Weights are reloaded in place through vLLM's layer-wise reload (which re-runs the CPU kernels' weight repacking
that a plain ``load_weights`` would skip); buckets arrive packed (see :mod:`megatron_pacs.rollout.sync`). Two
repairs follow the reload: buffers no checkpoint holds are fed their own values (:func:`_reload_derived_buffers`),
and fused-MoE kernels that keep a private copy of the experts prepare it again (:func:`_reprepare_moe_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_pacs.rollout.sync import (
    TensorMeta,
    add_tied_lm_head,
    broadcast_buffer,
    close_group,
    rebuild_ipc,
    standalone_group,
    unpack_bucket,
)

__all__ = ["WeightSyncExtension", "deferred_attention_check", "plain_metas", "vllm_features"]


def _metas(raw: Sequence[Any]) -> list[TensorMeta]:
    # Metadata crosses vLLM's RPC as plain lists in multiprocess mode.
    return [m if isinstance(m, TensorMeta) else TensorMeta(m[0], tuple(m[1]), m[2], m[3], m[4]) for m in raw]


def plain_metas(metas: Sequence[TensorMeta]) -> list[list[Any]]:
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
