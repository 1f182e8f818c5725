"""The objective: PACS (the default) or the GRPO baseline, and their hyper-parameters (docs/algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad

__all__ = ["LossConfig"]

CHOICES = {
    "loss": ("pacs", "grpo"),
    "pacs_score": ("log_ratio", "mean_logp"),
    "pacs_advantage": ("rloo", "grpo", "grpo_no_std", "naive"),
    "pacs_weights": ("balanced", "none", "only_positive", "only_negative"),
}


@dataclass(kw_only=True)
class LossConfig:
    """The objective."""

    loss: str = "pacs"
    """pacs or grpo."""
    pacs_beta: float = 1.0
    """PACS critic temperature beta."""
    pacs_score: str = "log_ratio"
    """log_ratio (beta * (l - l_old)) or mean_logp (beta * l / L)."""
    pacs_advantage: str = "rloo"
    """Group logit: rloo, grpo, grpo_no_std or naive."""
    pacs_weights: str = "balanced"
    """BCE weights: balanced, none, only_positive or only_negative."""
    clip_ratio: float = 0.2
    """GRPO's PPO clip epsilon."""
    kl_coef: float = 0.0
    """KL penalty to a frozen reference model; reserved: only 0 is accepted until the reference model lands."""

    def __post_init__(self) -> None:
        for name, valid in CHOICES.items():
            if getattr(self, name) not in valid:
                raise bad(name, f"{getattr(self, name)!r} is not one of {list(valid)}")
        if not self.pacs_beta > 0:
            raise bad("pacs_beta", "must be > 0")
        if not 0 < self.clip_ratio < 1:
            raise bad("clip_ratio", f"{self.clip_ratio} must lie in (0, 1); PPO's usual value is 0.2")
        if self.kl_coef < 0:
            raise bad("kl_coef", "must be >= 0")
        if self.kl_coef > 0:
            raise bad(
                "kl_coef",
                "the reference-model KL term is not implemented yet; use 0 (the PACS and GRPO recipes of the "
                "paper use no KL)",
            )
