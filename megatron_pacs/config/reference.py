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
    ref_reset_lr_warmup_steps: int = 0
    """After each optimizer reset, ramp the learning rate back linearly over N optimizer steps (lr / N, 2 lr / N,
    ...; 0: none). The first Adam step after a reset is otherwise close to lr * sign(g) per element, at the full
    rate (docs/algorithm.md §2.2)."""

    def __post_init__(self) -> None:
        if self.ref_reset_interval < 0:
            raise bad("ref_reset_interval", f"{self.ref_reset_interval} must be >= 0 (0 never resets)")
        if self.ref_reset_lr_warmup_steps < 0:
            raise bad("ref_reset_lr_warmup_steps", f"{self.ref_reset_lr_warmup_steps} must be >= 0 (0: no re-warm-up)")
        if self.ref_reset_lr_warmup_steps and not (self.ref_reset_interval and self.ref_reset_optimizer):
            raise bad(
                "ref_reset_lr_warmup_steps",
                "re-warms the learning rate after an optimizer reset; it needs --ref-reset-interval N and the "
                "optimizer reset (drop --no-ref-reset-optimizer), or drop the flag",
            )
        if not self.ref_reset_optimizer and not self.ref_reset_interval:
            raise ValueError(
                "--no-ref-reset-optimizer: only means something with reference resets; add --ref-reset-interval N "
                "or drop the flag"
            )
