"""Qwen3-MoE weights on the local layer spec: the expert and router names mbridge does not know.

mbridge's MoE bridges know Transformer Engine's grouped experts only (``mlp.experts.linear_fc1.weight{i}``); the
local spec's ``SequentialMLP`` holds one MLP per expert (``mlp.experts.local_experts.{i}.linear_fc1.weight``). The
bridge here extends the dense Qwen3 mapping (attention, norms, embeddings) with the router
(``mlp.router.weight`` <-> ``mlp.gate.weight``) and the experts (``linear_fc1`` = gate and up stacked, ``linear_fc2``
= down), numbering a rank's local experts by its place in the expert-parallel group. Experts are not split over
tensor parallelism (expert tensor parallelism is 1): every TP rank of an EP rank holds its experts whole.

Hugging Face checkpoints store each expert separately (``model.layers.{L}.mlp.experts.{i}.gate_proj.weight``),
while transformers 5 fuses them in memory (``experts.gate_up_proj``): the checkpoint's names come from
:func:`megatron_pacs.utils.hf_checkpoint.hf_state_dict_shapes`, not from the in-memory model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.mcore.parallel import ParallelGroups

__all__ = ["EXPERT_NAME", "expert_bridge", "gather_experts"]

EXPERT_NAME = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
"""A local-spec expert weight: group 1 is the rank's local expert index, group 2 the layer (1: gate+up, 2: down)."""

_ROUTER = ".mlp.router.weight"
_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\.(?:gate|up|down)_proj\.weight)$")


def _whole_on_every_tp_rank(mcore_name: str) -> bool:
    """The router and the experts: not split over tensor parallelism (expert tensor parallelism is 1)."""
    return bool(EXPERT_NAME.search(mcore_name)) or mcore_name.endswith(_ROUTER)


def gather_experts(
    name: str, tensor: torch.Tensor, groups: ParallelGroups, hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """One exported ``(hf_name, tensor)``, or for an expert's tensor at EP > 1, that expert of every rank of the
    expert-parallel group under its owner's number (the bridge numbers a rank's experts from 0).

    Every rank of the EP group reaches the same exported name at the same time (they hold the same layers), so the
    all-gather here pairs up.
    """
    m = _HF_EXPERT.match(name)
    if m is None or groups.ep_size == 1:
        yield name, tensor
        return
    assert groups.ep_group is not None
    every = [torch.empty_like(tensor) for _ in range(groups.ep_size)]
    dist.all_gather(every, tensor.contiguous(), group=groups.ep_group)
    per_rank = hf_config.num_experts // groups.ep_size
    for rank, part in enumerate(every):
        yield f"{m.group(1)}{int(m.group(2)) + rank * per_rank}{m.group(3)}", part


def expert_bridge(base: type) -> type:
    """A subclass of the dense bridge ``base`` (the local-spec Qwen3 bridge) that maps the router and the experts."""

    class ExpertBridge(base):
        def _build_config(self) -> Any:
            # The dense base's config with the expert fields Megatron requires at EP > 1 (the bridge reads only
            # gated_linear_unit from it).
            c = self.hf_config
            return self._build_base_config(
                qk_layernorm=True,
                num_moe_experts=c.num_experts,
                moe_router_topk=c.num_experts_per_tok,
                moe_ffn_hidden_size=c.moe_intermediate_size,
                expert_tensor_parallel_size=1,
            )

        def _experts_per_rank(self) -> int:
            return self.hf_config.num_experts // self.mpu.ep_size

        #: Set while mbridge's load_weights runs: the experts are left out of its mapping and loaded apart.
        _experts_apart = False

        def load_weights(self, models: list[Any], weights_path: str, memory_efficient: bool = False) -> None:
            # mbridge reads a weight the local spec holds whole on every TP rank on TP rank 0 and scatters it over
            # the TP group; at TP > 1 and EP > 1 a TP group's ranks hold different experts (TP2 x EP2 on 4 ranks:
            # the TP group is the EP group), so that gave TP rank 1 rank 0's. Each rank reads its own experts.
            self._experts_apart = True
            try:
                super().load_weights(models, weights_path, memory_efficient)
            finally:
                self._experts_apart = False
            for model in models:
                state = model.state_dict()
                for local, name in self._weight_name_mapping_mcore_local_to_global(model).items():
                    if EXPERT_NAME.search(name):
                        hf_names = self._weight_name_mapping_mcore_to_hf(name)
                        weights = [self.safetensor_io.load_one_hf_weight(x) for x in hf_names]
                        state[local].copy_(self._weight_to_mcore_format(local, weights))

        def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            if self._experts_apart:
                return {local: name for local, name in names.items() if not EXPERT_NAME.search(name)}
            if not consider_ep or self.mpu.ep_size == 1:
                return names
            offset = self._experts_per_rank() * self.mpu.ep_rank
            out = {}
            for local, name in names.items():
                m = EXPERT_NAME.search(name)
                if m:
                    expert = int(m.group(1)) + offset
                    name = f"{name[: m.start()]}.mlp.experts.local_experts.{expert}.linear_fc{m.group(2)}.weight"
                out[local] = name
            return out

        def _weight_name_mapping_mlp(self, name: str) -> list[str]:
            layer = name.split(".")[2]
            if name.endswith(_ROUTER):
                return [f"model.layers.{layer}.mlp.gate.weight"]
            m = EXPERT_NAME.search(name)
            if m is None:
                return super()._weight_name_mapping_mlp(name)
            prefix = f"model.layers.{layer}.mlp.experts.{m.group(1)}"
            if m.group(2) == "1":
                return [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
            return [f"{prefix}.down_proj.weight"]

        def _weight_merge_across_tp(
            self, mcore_weights_name: str, mcore_weights: list[torch.Tensor], param: torch.Tensor
        ) -> torch.Tensor:
            if _whole_on_every_tp_rank(mcore_weights_name):
                # This rank's own: at EP > 1 the ranks of a TP group may hold different experts.
                return mcore_weights[self.mpu.tp_rank]
            return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)

        def _weight_split_across_tp(
            self, mcore_weights_name: str, mcore_weights: torch.Tensor, param: torch.Tensor, tp_split_size: int
        ) -> list[torch.Tensor]:
            if _whole_on_every_tp_rank(mcore_weights_name):
                return [mcore_weights] * tp_split_size
            return super()._weight_split_across_tp(mcore_weights_name, mcore_weights, param, tp_split_size)

    ExpertBridge.__name__ = f"Expert{base.__name__}"
    return ExpertBridge
