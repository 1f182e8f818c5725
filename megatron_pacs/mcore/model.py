"""Megatron-Core ``GPTModel`` from a Hugging Face config: Qwen2/Qwen2.5, Qwen3, Qwen3-MoE and Llama-3 families.

Layer specs: Transformer Engine on GPU when it imports; on GPU without TE, the local spec with core attention
through ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN backends); the local spec on CPU. Core
attentions of the sdpa and local specs (padded and packed rows) live in :mod:`megatron_pacs.mcore.attention`.
Norms are an RMSNorm with Hugging Face's numerics (normalise in fp32, cast back, then scale), tagged for sequence
parallelism, so the local spec matches HF and works with ``sequence_parallel=True``.

Fusions (GPU only; the CPU arithmetic stays unfused and exact): TE's own on the TE spec, plus Megatron's fused RoPE
there; Megatron's SwiGLU fusion (``torch.compile``-fused, saves only its input) on every GPU spec; the masked
softmax fusion where Apex's kernels import; the RMSNorm through ``F.rms_norm`` (one fused kernel) on CUDA.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.attention import LocalAttention, SDPAttention
from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.parallel import ParallelGroups

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Fusions",
    "MegatronModule",
    "apex_softmax_available",
    "build_gpt_model",
    "hf_to_transformer_config",
    "resolve_fusions",
    "rope_settings",
    "silence_te_fp8_autocast_deprecation",
    "te_available",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
SPECS = ("auto", "te", "sdpa", "local")


def te_available() -> bool:
    """True when Transformer Engine's PyTorch layers import (GPU clusters)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a half-installed TE raises all sorts of errors
        return False
    return True


TE_FP8_AUTOCAST_DEPRECATION = "fp8_autocast is deprecated and will be removed in a future release."
"""The first sentence of Transformer Engine's DeprecationWarning for ``te.pytorch.fp8_autocast`` (TE 2.x, once
``te.pytorch.autocast`` exists; the second sentence lists autocast's arguments, which vary between releases)."""


def silence_te_fp8_autocast_deprecation() -> bool:
    """Filter TE's ``fp8_autocast`` deprecation warning where TE has its replacement (``te.pytorch.autocast``).

    megatron-core 0.16's ``get_fp8_context`` enters ``fp8_autocast`` around every layer of every FP8 pass, so TE
    2.20 would warn on each; the call is megatron-core's, not ours, and megatron-core moves to ``autocast`` itself
    in later releases. Only that message (a prefix match) and only DeprecationWarning are filtered.

    Returns:
        True if the filter is installed (TE imports and has ``autocast``), else False.
    """
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - a half-installed TE raises all sorts of errors
        return False
    if not hasattr(te, "autocast"):  # an older TE: fp8_autocast is the current API and does not warn
        return False
    warnings.filterwarnings("ignore", message=re.escape(TE_FP8_AUTOCAST_DEPRECATION), category=DeprecationWarning)
    return True


class HFRMSNorm(torch.nn.Module):
    """RMSNorm with Hugging Face's numerics, accepted by Megatron with ``sequence_parallel=True``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces the grads of sequence-parallel params over TP.
        # Megatron's convention: flags set as attributes on the Parameter (torch does not declare them).
        self.weight.sequence_parallel = config.sequence_parallel  # pyright: ignore[reportAttributeAccessIssue]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda:  # one fused kernel, the same formula (the CPU path below stays bit-exact to HF)
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apex_softmax_available() -> bool:
    """True when Apex's fused masked-softmax CUDA kernels import (Megatron's ``masked_softmax_fusion``)."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401  # pyright: ignore[reportMissingImports]
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Fusions:
    """``TransformerConfig`` fusion switches, resolved for a spec and a machine (see :func:`resolve_fusions`)."""

    bias_activation_fusion: bool = False
    apply_rope_fusion: bool = False
    masked_softmax_fusion: bool = False


def resolve_fusions(
    spec: str, *, bias_swiglu: bool | None = None, rope: bool | None = None, masked_softmax: bool | None = None
) -> Fusions:
    """Fusion switches for a resolved spec (``te`` / ``sdpa`` / ``local``) on this machine.

    None means automatic: SwiGLU fused on GPU; RoPE fused with Transformer Engine (its kernel); masked softmax fused
    on the local spec when Apex's kernels import. On CPU everything stays unfused (exact against HF). An explicit
    True that cannot work here raises ``ValueError`` naming the flag.
    """
    gpu = torch.cuda.is_available()

    def pick(name: str, asked: bool | None, possible: bool, why: str) -> bool:
        if asked and not possible:
            raise ValueError(f"--{name}: {why}; drop the flag (or use --no-{name})")
        return possible if asked is None else asked

    return Fusions(
        bias_activation_fusion=pick("bias-swiglu-fusion", bias_swiglu, gpu, "needs CUDA"),
        apply_rope_fusion=pick("rope-fusion", rope, gpu and spec == "te", "needs CUDA and the TE spec"),
        masked_softmax_fusion=pick(
            "masked-softmax-fusion",
            masked_softmax,
            gpu and spec == "local" and apex_softmax_available(),
            "needs CUDA, the local spec and Apex's fused softmax kernels",
        ),
    )


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    return getattr(hf_config, name, default)


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel RoPE arguments from the checkpoint: theta and the scaling Megatron can express exactly.

    Raises:
        ValueError: for scaling types Megatron's RoPE cannot reproduce (yarn, dynamic, llama3 with
            non-default frequency factors).
    """
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    theta = _get(hf_config, "rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    out: dict[str, Any] = {"rotary_base": theta, "rope_scaling": False, "seq_len_interpolation_factor": None}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return out
    if kind == "linear":
        out["seq_len_interpolation_factor"] = float(scaling["factor"])
        return out
    if kind == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        bad = {k: scaling.get(k) for k, v in expected.items() if float(scaling.get(k, v)) != float(v)}
        if bad:
            raise ValueError(
                f"rope_scaling {bad} differs from the Llama-3.1 defaults {expected} that Megatron's RoPE implements"
            )
        out.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
        return out
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


def moe_settings(hf_config: Any, parallel: ParallelConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """``TransformerConfig`` fields of a Qwen3-MoE checkpoint (every layer sparse, no shared expert).

    HF's router takes the softmax over every expert, keeps the top k and, with ``norm_topk_prob``, renormalises
    them: that equals Megatron's top-k over the logits followed by a softmax over the k kept
    (``moe_router_pre_softmax=False``); without it, Megatron's softmax before the top-k
    (``moe_router_pre_softmax=True``). Load balancing is off unless ``--moe-router-load-balancing-type`` asks for it
    (RL updates a trained router; an auxiliary loss would pull it away from the policy gradient); with it on,
    ``moe_aux_loss_coeff`` defaults to the checkpoint's ``router_aux_loss_coef``. ``overrides`` are the caller's
    ``TransformerConfig`` overrides (read for those two).

    Raises:
        ValueError: for layouts the model cannot express yet: dense layers among the MoE ones (``mlp_only_layers``,
            ``decoder_sparse_step != 1``) and shared experts; for experts that ``--expert-model-parallel-size``
            does not divide; for TP > 1 without sequence parallelism (Megatron refuses MoE there).
    """
    experts = hf_config.num_experts
    if _get(hf_config, "mlp_only_layers"):
        raise ValueError(
            f"mlp_only_layers={hf_config.mlp_only_layers}: dense layers among the MoE layers are not supported yet"
        )
    if _get(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"decoder_sparse_step={hf_config.decoder_sparse_step}: only every layer sparse (1) is supported yet"
        )
    if _get(hf_config, "shared_expert_intermediate_size"):
        raise ValueError("shared experts (shared_expert_intermediate_size) are not supported yet")
    if parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ValueError(
            "sequence_parallel: Megatron's MoE layers need --sequence-parallel at --tensor-model-parallel-size "
            f"{parallel.tensor_model_parallel_size}; add it"
        )
    ep = parallel.expert_model_parallel_size
    if experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide num_experts={experts}")
    balance = overrides.get("moe_router_load_balancing_type", "none")
    coeff = overrides.get("moe_aux_loss_coeff")
    if coeff is None:
        coeff = _get(hf_config, "router_aux_loss_coef", 0.0)
    return dict(
        num_moe_experts=experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_pre_softmax=not _get(hf_config, "norm_topk_prob", False),
        moe_router_score_function="softmax",
        moe_router_load_balancing_type=balance,
        moe_aux_loss_coeff=0.0 if balance == "none" else coeff,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher_type,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def hf_to_transformer_config(
    hf_config: Any,
    parallel: ParallelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    recompute: bool = False,
    fusions: Fusions | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """Translate a Hugging Face causal-LM config into Megatron's ``TransformerConfig``.

    Args:
        hf_config: A ``transformers`` config of a supported family (``SUPPORTED_MODEL_TYPES``).
        parallel: The TP / PP / VPP / SP layout.
        dtype: ``torch.float32`` or ``torch.bfloat16`` parameters and compute.
        recompute: Full activation recompute of every layer.
        fusions: Fusion switches (default: all off, the exact unfused path).
        **overrides: Extra ``TransformerConfig`` fields (e.g. ``calculate_per_token_loss=True``).
    """
    fusions = fusions or Fusions()
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32 or torch.bfloat16")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; these families use 'silu' (SwiGLU)")
    tp = parallel.tensor_model_parallel_size
    heads, groups = (
        hf_config.num_attention_heads,
        _get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads,
    )
    if heads % tp or groups % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads} and num_key_value_heads={groups}"
        )
    if hf_config.vocab_size % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide vocab_size={hf_config.vocab_size}")
    if hf_config.num_hidden_layers % parallel.pipeline_model_parallel_size:
        raise ValueError(
            f"pipeline_model_parallel_size={parallel.pipeline_model_parallel_size} must divide "
            f"num_hidden_layers={hf_config.num_hidden_layers}"
        )
    on_cpu = not torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=_get(hf_config, "head_dim") or hf_config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=_get(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2" or bool(_get(hf_config, "attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        overlap_p2p_comm=parallel.overlap_p2p_comm,
        batch_p2p_comm=parallel.batch_p2p_comm,
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=fusions.bias_activation_fusion,
        masked_softmax_fusion=fusions.masked_softmax_fusion,
        apply_rope_fusion=fusions.apply_rope_fusion,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # megatron-core 0.16.1 defaults to the deprecated "full" scope (and warns); [] means the same.
        cuda_graph_scope=[],
    )
    if model_type == "qwen3_moe":
        kw.update(moe_settings(hf_config, parallel, overrides))
    else:
        given = sorted(k for k in overrides if k.startswith("moe_"))
        if given or parallel.expert_model_parallel_size > 1:
            what = given or ["expert_model_parallel_size"]
            raise ValueError(f"{', '.join(what)}: only for MoE checkpoints; model_type={model_type!r} is dense")
    if on_cpu:
        kw["batch_p2p_sync"] = False
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _local_spec(config: TransformerConfig, core_attention: type | None, vp_stage: int | None):
    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,  # SequentialMLP: one plain MLP per expert (grouped GEMM is the TE spec's)
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    # ModuleSpec types its submodules as `object`; the local spec's are a TransformerLayer's and a SelfAttention's.
    layer_submodules = cast(TransformerLayerSubmodules, layer.submodules)
    layer_submodules.input_layernorm = HFRMSNorm
    layer_submodules.pre_mlp_layernorm = HFRMSNorm
    attn = cast(SelfAttentionSubmodules, cast(ModuleSpec, layer_submodules.self_attention).submodules)
    if config.qk_layernorm:
        attn.q_layernorm = HFRMSNorm
        attn.k_layernorm = HFRMSNorm
    attn.core_attention = core_attention or LocalAttention
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    # layer_norm is typed ModuleSpec | Module, but Megatron's build_module takes a class too (its own specs pass one).
    return TransformerBlockSubmodules(
        layer_specs=[layer] * n,
        layer_norm=HFRMSNorm,  # pyright: ignore[reportArgumentType]
    )


def _te_spec(config: TransformerConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.num_moe_experts is not None,
        qk_layernorm=config.qk_layernorm,
    )


def _reduce_experts_over_expert_data_parallel(model: torch.nn.Module) -> None:
    """Mark every expert weight for DDP's expert buffers (``allreduce=False``), whatever the EP size.

    Megatron marks them only at EP > 1 and otherwise reduces them over the data-parallel group. With expert tensor
    parallelism 1 under TP > 1 (sequence parallel) each TP rank routes only its own tokens, so an expert's gradient
    is split over the TP ranks too: only the expert-data-parallel group (which spans them) sums it. Measured at
    TP=2, EP=1: expert gradients short by the other rank's tokens without this.
    """
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False  # pyright: ignore[reportAttributeAccessIssue] - Megatron's parameter tag


def resolve_spec(spec: str) -> str:
    """``auto`` -> ``te`` (GPU with TE), ``sdpa`` (GPU without TE) or ``local`` (CPU)."""
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r} is not valid; choose one of {list(SPECS)}")
    if spec != "auto":
        if spec == "te" and not te_available():
            raise ValueError("spec='te' needs Transformer Engine (pip install -e '.[gpu]' on a CUDA machine)")
        return spec
    if not torch.cuda.is_available():
        return "local"
    return "te" if te_available() else "sdpa"


def build_gpt_model(
    hf_config: Any,
    groups: ParallelGroups,
    *,
    dtype: torch.dtype = torch.float32,
    recompute: bool = False,
    spec: str = "auto",
    fusions: dict[str, bool | None] | None = None,
    **config_overrides: Any,
) -> list[GPTModel]:
    """Build this rank's model chunks (one, or one per virtual stage), with random weights.

    Load weights with :func:`megatron_pacs.mcore.weights.load_hf_weights`.

    Args:
        hf_config: Hugging Face config (``AutoConfig.from_pretrained(dir)``).
        groups: From :func:`megatron_pacs.mcore.parallel.init_parallel`.
        dtype: Parameter dtype.
        recompute: Full activation recompute.
        spec: ``auto`` | ``te`` | ``sdpa`` | ``local``.
        fusions: ``bias_swiglu`` / ``rope`` / ``masked_softmax`` requests for :func:`resolve_fusions` (None or a
            missing key: automatic).
        **config_overrides: Passed to :func:`hf_to_transformer_config`.

    Returns:
        Model chunks in virtual-stage order, on the current device.
    """
    kind = resolve_spec(spec)
    if config_overrides.get("fp8") and kind != "te":
        # Only Transformer Engine's layers run FP8 GEMMs; the other specs would silently run bf16.
        raise ValueError(f"fp8={config_overrides['fp8']!r} needs the Transformer Engine spec; got spec={kind!r}")
    if config_overrides.get("fp8"):
        silence_te_fp8_autocast_deprecation()
    if _get(hf_config, "model_type") == "qwen3_moe":
        config_overrides.setdefault("moe_grouped_gemm", kind == "te")  # TE's grouped GEMM, else one MLP per expert
    config = hf_to_transformer_config(
        hf_config,
        groups.config,
        dtype=dtype,
        recompute=recompute,
        fusions=resolve_fusions(kind, **(fusions or {})),
        **config_overrides,
    )
    rope = rope_settings(hf_config)
    vpp = groups.config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        if kind == "te":
            layer_spec = _te_spec(config)
        else:
            layer_spec = _local_spec(config, SDPAttention if kind == "sdpa" else None, vp_stage)
        first_chunk = vp_stage in (None, 0)
        last_chunk = vp_stage is None or vp_stage == (vpp or 1) - 1  # an int vp_stage means vpp is set
        with cuda_to_cpu():  # tied embeddings under PP sync the output layer with a `.cuda()` all-reduce
            model = GPTModel(
                config=config,
                # Typed ModuleSpec, but TransformerBlock takes TransformerBlockSubmodules too (Megatron's block specs).
                transformer_layer_spec=layer_spec,  # pyright: ignore[reportArgumentType]
                vocab_size=hf_config.vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                pre_process=groups.is_first_stage and first_chunk,
                post_process=groups.is_last_stage and last_chunk,
                share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
                position_embedding_type="rope",
                rotary_base=rope["rotary_base"],
                rope_scaling=rope["rope_scaling"],
                rope_scaling_factor=rope.get("rope_scaling_factor", 8.0),
                seq_len_interpolation_factor=rope["seq_len_interpolation_factor"],
                parallel_output=True,
                pg_collection=groups.pg_collection,
                vp_stage=vp_stage,
            )
        if config.num_moe_experts:
            _reduce_experts_over_expert_data_parallel(model)
        if torch.cuda.is_available():
            model = model.cuda()
        chunks.append(model)
    return chunks
