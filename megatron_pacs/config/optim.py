"""The optimizer: AdamW through Megatron's optimizer, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad

__all__ = ["OptimConfig"]


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW (decoupled weight decay) through Megatron's optimizer; fp32 main params and gradients."""

    lr: float = 1e-6
    """Peak learning rate (reached after the warm-up, then constant; the reference uses 1e-6); 0 freezes the
    policy (a measurement run: every step computes the same update, nothing moves)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up (warm-up step k uses lr * (k + 1) / lr-warmup-steps)."""
    lr_decay_steps: int = 0
    """After the warm-up, decay linearly towards 0 over this many optimizer steps (0: constant, as PACS and GRPO
    use)."""
    weight_decay: float = 0.01
    """Decoupled weight decay of matrices; biases and 1-D parameters (norms) get none."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value; 0 = off (the PACS reference does not clip)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer; GPU only)."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise bad("lr", f"{self.lr} must be >= 0 (0 freezes the policy)")
        if self.weight_decay < 0:
            raise bad("weight_decay", f"{self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad(name, f"{getattr(self, name)} must be in [0, 1)")
        if not self.adam_eps > 0:
            raise bad("adam_eps", f"{self.adam_eps} must be > 0")
        if self.clip_grad < 0:
            raise bad("clip_grad", f"{self.clip_grad} must be >= 0 (0 turns clipping off)")
        for name in ("lr_warmup_steps", "lr_decay_steps"):
            if getattr(self, name) < 0:
                raise bad(name, f"{getattr(self, name)} must be >= 0")
