"""PPO's learned critic (``--loss ppo``): its model, its optimizer, GAE and the value loss (docs/algorithm.md §6.5).

The defaults are the released PPO baseline's (the PACS repository's ``scripts/baseline/ppo.sh`` on its verl): the
critic starts from the actor's checkpoint with a new one-output head, AdamW at 1e-5 with weight decay 0.01 and a
gradient clip of 1.0 on the actor's (constant) schedule, GAE with gamma = lambda = 1, a value clip of 0.5, no
warm-up and no KL in the reward. Every field here belongs to ``--loss ppo``: another objective refuses it
(:meth:`~megatron_pacs.config.train.TrainConfig.validate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_pacs.config.base import bad, is_set

__all__ = ["CriticConfig"]


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model and its training (only with --loss ppo)."""

    critic_hf_model: str | None = None
    """Hugging Face directory the critic starts from (its LM head replaced by a one-output value head, or an exported
    critic's score head kept: tools/convert_checkpoint.py mcore-to-hf --critic); default: --hf-model. Its vocabulary
    and architecture must score the actor's tokens."""
    critic_lr: float = 1e-5
    """The critic's peak learning rate (AdamW; it follows the actor's --lr-warmup-steps / --lr-decay-steps)."""
    critic_weight_decay: float = 0.01
    """The critic's decoupled weight decay of matrices (biases and norms get none)."""
    critic_clip_grad: float = 1.0
    """Clip the critic's global gradient norm to this value (0: off)."""
    gae_gamma: float = 1.0
    """GAE discount gamma in [0, 1]."""
    gae_lambda: float = 1.0
    """GAE lambda in [0, 1] (1: Monte-Carlo returns minus the values; 0: one-step TD errors)."""
    value_clip: float = 0.5
    """The value loss's clip c: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2) per token."""
    critic_warmup: int = 0
    """Training steps 1..N train the critic only: the actor is not updated and the engines keep their weights."""
    reward_kl_coef: float = 0.0
    """A per-token penalty -coef * (log pi_old - log pi_ref) in the reward, which the critic's returns include
    (PPO-style; needs the reference policy; refused with --kl-coef > 0, the KL loss term)."""

    def __post_init__(self) -> None:
        for name in ("critic_lr", "critic_weight_decay", "critic_clip_grad", "reward_kl_coef"):
            if getattr(self, name) < 0:
                raise bad(name, f"{getattr(self, name)} must be >= 0")
        for name in ("gae_gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise bad(name, f"{getattr(self, name)} must lie in [0, 1]")
        if not self.value_clip > 0:
            raise bad("value_clip", f"{self.value_clip} must be > 0 (verl's cliprange_value; the released run: 0.5)")
        if self.critic_warmup < 0:
            raise bad("critic_warmup", f"{self.critic_warmup} must be >= 0 (0: the actor trains from step 1)")

    def set_fields(self) -> list[str]:
        """The fields given a value other than their default (what another objective refuses)."""
        return [f.name for f in dataclasses.fields(self) if is_set(self, f.name)]
