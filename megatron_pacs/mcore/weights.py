"""HF <-> Megatron weights, exact both ways, on the TP/PP-sharded model.

The name and layout mapping (QKV interleaving for GQA, gate/up fusion, TP splits) comes from mbridge; this module
adds only what mbridge lacks for the local layer spec (separate ``input_layernorm`` / ``pre_mlp_layernorm``
parameters, where its mappings know only Transformer Engine's fused names) and keeps its per-class mapping
tables per instance (mbridge edits a class-level dict for tied embeddings, which would leak into the next model).

Loading reads one safetensors tensor at a time on TP rank 0 of each stage and scatters the shards (MoE experts:
each rank reads its own, see :mod:`megatron_pacs.mcore.moe_weights`). Export is a streaming iterator of
``(hf_name, tensor)`` gathered over TP and PP: every rank must drain it (collectives).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from mbridge.core.parallel_states import ParallelStates
from mbridge.models.llama import LLaMABridge
from mbridge.models.qwen2 import Qwen2Bridge
from mbridge.models.qwen3 import Qwen3Bridge

from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.moe_weights import expert_bridge, gather_experts
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.utils.hf_checkpoint import check_hf_checkpoint

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = ["export_hf_weights", "load_hf_weights", "make_bridge"]

_LOCAL_SPEC_NAMES = {
    "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
}


def _local_spec_bridge(base: type) -> type:
    class LocalSpecBridge(base):
        #: Megatron parameter-name prefixes this bridge leaves alone (a critic's value head has no HF tensor).
        skip: tuple[str, ...] = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            for table in ("_DIRECT_MAPPING", "_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING"):
                setattr(self, table, copy.deepcopy(getattr(base, table, {})))
            self._OTHER_MAPPING.update({"input_layernorm.weight": _LOCAL_SPEC_NAMES["input_layernorm.weight"]})
            self._MLP_MAPPING.update({"pre_mlp_layernorm.weight": _LOCAL_SPEC_NAMES["pre_mlp_layernorm.weight"]})
            super().__init__(*args, **kwargs)

        def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)
            return {k: v for k, v in names.items() if not k.startswith(self.skip)} if self.skip else names

        def _build_base_config(self, **kwargs: Any) -> Any:
            # mbridge keeps megatron-core's deprecated default cuda_graph_scope ("full", which warns); [] is the same.
            return super()._build_base_config(**{"cuda_graph_scope": [], **kwargs})

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge


_BRIDGES = {
    "qwen2": _local_spec_bridge(Qwen2Bridge),
    "qwen3": _local_spec_bridge(Qwen3Bridge),
    "llama": _local_spec_bridge(LLaMABridge),
}
_BRIDGES["qwen3_moe"] = expert_bridge(_BRIDGES["qwen3"])


def _parallel_states(groups: ParallelGroups) -> ParallelStates:
    return ParallelStates(
        tp_size=groups.tp_size,
        tp_rank=groups.tp_rank,
        pp_size=groups.pp_size,
        pp_rank=groups.pp_rank,
        vpp_size=groups.config.virtual_pipeline_model_parallel_size or 1,
        tp_group=groups.tp_group,
        pp_group=groups.pp_group,
        ep_size=groups.ep_size,
        ep_rank=groups.ep_rank,
        ep_group=groups.ep_group if groups.ep_group is not None else groups.dp_group,  # unused at EP=1
        etp_group=groups.tp_group,
    )


def make_bridge(
    hf_config: Any, groups: ParallelGroups, dtype: torch.dtype = torch.float32, *, skip: tuple[str, ...] = ()
) -> Any:
    """An mbridge bridge for ``hf_config``'s family, aware of the local-spec norm names; Megatron parameters whose
    names start with one of ``skip`` are neither loaded nor exported."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _BRIDGES:
        raise ValueError(f"no weight mapping for model_type={model_type!r}; supported: {sorted(_BRIDGES)}")
    if getattr(hf_config, "rope_theta", None) is None:
        # transformers 5 moved rope_theta into rope_parameters; mbridge reads the attribute.
        params = getattr(hf_config, "rope_parameters", None) or {}
        hf_config.rope_theta = params.get("rope_theta", 10000.0)
    bridge = _BRIDGES[model_type](hf_config, dtype=dtype, parallel_states=_parallel_states(groups))
    bridge.skip = skip
    return bridge


def load_hf_weights(
    models: Sequence[MegatronModule],
    hf_dir: str,
    groups: ParallelGroups,
    hf_config: Any,
    *,
    skip: tuple[str, ...] = (),
) -> None:
    """Load a Hugging Face safetensors checkpoint into this rank's model chunks, exactly.

    Args:
        models: Chunks from :func:`megatron_pacs.mcore.model.build_gpt_model`.
        hf_dir: Directory with ``config.json`` and safetensors (sharded with an index, or single).
        groups: The parallel groups the models were built with.
        hf_config: The checkpoint's config.
        skip: Megatron parameter-name prefixes to leave as built (a critic's ``output_layer.``, its value head).

    Raises:
        ValueError: naming the missing tensor, or the parameter whose shape differs from the checkpoint's.
    """
    check_hf_checkpoint(hf_dir, hf_config)
    bridge = make_bridge(hf_config, groups, dtype=models[0].config.params_dtype, skip=skip)
    with cuda_to_cpu():
        try:
            bridge.load_weights(models, hf_dir, memory_efficient=True)
        except RuntimeError as e:
            if "size" in str(e) or "shape" in str(e):
                msg = f"{hf_dir}: a tensor's shape does not match the model built from its config: {e}"
                raise ValueError(msg) from e
            raise


def export_hf_weights(
    models: Sequence[MegatronModule], groups: ParallelGroups, hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream this model's weights as ``(hf_name, full tensor)`` in Hugging Face layout.

    Gathered over TP and broadcast over PP one tensor at a time (bounded memory); MoE experts are gathered over
    expert parallelism and named by their owner's numbering. Every rank must iterate to the end. Tied embeddings
    yield ``model.embed_tokens.weight`` once and no ``lm_head.weight``, like HF checkpoints.
    """
    bridge = make_bridge(hf_config, groups, dtype=models[0].config.params_dtype)
    seen: set[str] = set()
    stream = bridge.export_weights(models)
    while True:
        # Entered per tensor (the consumer's code between yields runs outside both). no_grad: the exporter
        # broadcasts live parameters in place, which would otherwise enter their autograd history.
        with cuda_to_cpu(), torch.no_grad():
            item = next(stream, None)
        if item is None:
            return
        for name, tensor in gather_experts(item[0], item[1], groups, hf_config):
            if name not in seen:
                seen.add(name)
                yield name, tensor.detach()
