"""A Hugging Face checkpoint folder's tensors: the names and shapes its config implies, and the check of a folder
against them. Headers only (safetensors) and a model on the meta device: no weights are read and no megatron is
imported, so a launcher can refuse a bad folder before it starts any rank."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["check_hf_checkpoint", "hf_state_dict_shapes"]


def hf_state_dict_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors a Hugging Face checkpoint of this config holds (no ``lm_head`` when tied).

    Args:
        hf_config: A transformers ``PretrainedConfig``.

    Returns:
        The checkpoint's tensor names (Qwen3-MoE: one tensor per expert, as ``save_pretrained`` writes them, where
        transformers 5 fuses the experts in memory) and their shapes.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    if getattr(hf_config, "model_type", None) == "qwen3_moe":
        shapes = _per_expert(shapes)
    return shapes


def check_hf_checkpoint(hf_dir: str, hf_config: Any) -> None:
    """Fail with the missing or misshaped tensor's name, or the unreadable file's, before any weight is read.

    Args:
        hf_dir: Directory with safetensors (sharded with an index, or single).
        hf_config: The checkpoint's config.

    Raises:
        ValueError: naming the folder and the tensor or file.
    """
    from safetensors import safe_open

    expected = hf_state_dict_shapes(hf_config)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir} holds no model.safetensors or model.safetensors.index.json")
    present: dict[str, tuple[int, ...]] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise ValueError(f"{hf_dir}: the index names {name}, which is missing")
        try:
            with safe_open(path, "pt") as f:
                present.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{path} is not a readable safetensors file (truncated?): {e}") from None
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ValueError(f"{hf_dir} is missing {len(missing)} tensors, first {missing[:3]}")
    for key, shape in expected.items():
        if present[key] != shape:
            raise ValueError(f"{hf_dir}: tensor {key} has shape {present[key]}, the config implies {shape}")


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` of an instantiated HF Qwen3-MoE with each layer's fused experts replaced by the per-expert tensors
    a ``save_pretrained`` checkpoint holds."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2 I, H]
            prefix = name[: -len("gate_up_proj")]
            for i in range(shape[0]):
                out[f"{prefix}{i}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                out[f"{prefix}{i}.up_proj.weight"] = (shape[1] // 2, shape[2])
        elif name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
            prefix = name[: -len("down_proj")]
            for i in range(shape[0]):
                out[f"{prefix}{i}.down_proj.weight"] = (shape[1], shape[2])
        else:
            out[name] = shape
    return out
