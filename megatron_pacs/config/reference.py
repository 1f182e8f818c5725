"""The frozen reference policy: where its weights come from, where they live, and when it is reset."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad

__all__ = ["ReferenceConfig"]


@dataclass(kw_only=True)
class ReferenceConfig:
    """The reference policy pi_ref (built only for --kl-coef > 0 or --pacs-score-reference ref)."""

    ref_load: str | None = None
    """Hugging Face directory of the reference policy; default: the actor's initial --hf-model."""
    ref_offload: bool = False
    """Keep the reference's weights in pinned host memory between uses (GPU only; refused without CUDA)."""
    ref_reset_interval: int = 0
    """At the end of every N-th training step the reference becomes an exact copy of the current policy
    (0: never; PACS v2 resets periodically, following ProRL)."""
    ref_reset_optimizer: bool = True
    """With each reset, reinitialise the Adam moments and step counters (the learning-rate schedule continues)."""

    def __post_init__(self) -> None:
        if self.ref_reset_interval < 0:
            raise bad("ref_reset_interval", f"{self.ref_reset_interval} must be >= 0 (0 never resets)")
        if not self.ref_reset_optimizer and not self.ref_reset_interval:
            raise ValueError(
                "--no-ref-reset-optimizer: only means something with reference resets; add --ref-reset-interval N "
                "or drop the flag"
            )
