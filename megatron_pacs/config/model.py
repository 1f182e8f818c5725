"""The model: where its weights come from, its precision and its layer implementation."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad

__all__ = ["ModelConfig"]

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
TRANSFORMER_IMPLS = ("auto", "te", "sdpa", "local")


@dataclass(kw_only=True)
class ModelConfig:
    """The model."""

    hf_model: str = ""
    """Hugging Face model directory: config, tokenizer and safetensors (the actor starts from these weights)."""
    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights and gradients (GPU)."""
    fp8_format: str | None = None
    """FP8 through Transformer Engine: e4m3 or hybrid (needs --bf16 and Transformer Engine)."""
    fp8_recipe: str = "delayed"
    """Transformer Engine FP8 recipe: delayed, tensorwise, mxfp8 or blockwise."""
    recompute_activations: bool = False
    """Full activation recompute: keep only each layer's input, recompute the rest in the backward pass."""
    transformer_impl: str = "auto"
    """Layer implementation: auto (TE on GPU when importable, else local), te, sdpa or local."""
    bias_swiglu_fusion: bool | None = None
    """Fuse the SwiGLU activation (Megatron's bias_swiglu_impl); default: on with CUDA, off on CPU (exact)."""
    rope_fusion: bool | None = None
    """Fused RoPE (Transformer Engine's kernel); default: on with the TE spec."""
    masked_softmax_fusion: bool | None = None
    """Apex's fused scale-mask-softmax in the local spec; default: on where Apex's kernels import."""

    def __post_init__(self) -> None:
        if self.fp8_format not in (None, *FP8_FORMATS):
            raise bad("fp8_format", f"{self.fp8_format!r} is not one of {list(FP8_FORMATS)}")
        if self.fp8_format and not self.bf16:
            raise bad("fp8_format", "FP8 training needs --bf16 as well")
        if self.fp8_recipe not in FP8_RECIPES:
            raise bad("fp8_recipe", f"{self.fp8_recipe!r}: use one of {list(FP8_RECIPES)}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise bad("transformer_impl", f"{self.transformer_impl!r}: use one of {list(TRANSFORMER_IMPLS)}")

    @property
    def fusions(self) -> dict[str, bool | None]:
        """The fusion requests, as ``megatron_pacs.mcore.model.resolve_fusions`` takes them."""
        return {
            "bias_swiglu": self.bias_swiglu_fusion,
            "rope": self.rope_fusion,
            "masked_softmax": self.masked_softmax_fusion,
        }

    @property
    def fp8(self) -> dict[str, str] | None:
        """``TransformerConfig`` FP8 settings (``fp8``, ``fp8_recipe``), or None when FP8 is off."""
        return {"fp8": self.fp8_format, "fp8_recipe": self.fp8_recipe} if self.fp8_format else None
