"""The objective: PACS (the default) or the GRPO baseline, and their hyper-parameters (docs/algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad, is_set

__all__ = ["LossConfig"]

# The names algo/ registers (objectives, advantages, weights, scores, KL estimators), spelled out so that config/
# imports nothing heavy; tests/config/test_loss.py proves they agree.
CHOICES = {
    "loss": ("pacs", "grpo"),
    "pacs_score": ("log_ratio", "mean_logp"),
    "pacs_score_reference": ("old", "ref"),
    "kl_estimator": ("k1", "k2", "k3", "k3+"),
    "off_policy_correction": ("none", "tis"),
    "tis_level": ("auto", "token", "geometric", "sequence"),
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
    """log_ratio (beta * (l - l_anchor)) or mean_logp (beta * l / L)."""
    pacs_score_reference: str = "old"
    """The log_ratio anchor: old (the rollout policy, as the released code) or ref (the frozen reference policy,
    PACS v2)."""
    pacs_advantage: str = "rloo"
    """Group logit: rloo, grpo, grpo_no_std or naive."""
    pacs_weights: str = "balanced"
    """BCE weights: balanced, none, only_positive or only_negative."""
    clip_ratio: float = 0.2
    """GRPO's PPO clip epsilon."""
    kl_coef: float = 0.0
    """KL penalty to the frozen reference policy: kl-coef x mean over responses of (sum of per-token estimates) /
    --max-response-length, added to the loss (0: none; a reference is then built only for the ref anchor)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator with r = log pi_ref - log pi. The value (ref/kl) estimates KL(pi || pi_ref); the
    gradient, in expectation per token: k1 (-r, score-function form), k2 (r^2 / 2) and k3+ (k3's value, k2's
    gradient) follow KL(pi || pi_ref); k3 (exp(r) - r - 1, value clamped at 10) follows the reverse KL(pi_ref || pi)
    (docs/algorithm.md §2.7)."""

    off_policy_correction: str = "none"
    """none, or tis: weight each response (PACS) or token (GRPO) by min(pi_anchor / pi_behaviour, --tis-cap), the
    behaviour being the engines' log-probs (docs/algorithm.md §5.1)."""
    tis_cap: float = 2.0
    """Truncation of the importance ratio with --off-policy-correction tis."""
    tis_level: str = "auto"
    """What one --off-policy-correction tis ratio covers: token (GRPO; Yao et al.), geometric (PACS: the response's
    per-token geometric mean, exp(mean_t log ratio_t), whose bias from engine/trainer numerics does not grow with
    the length) or sequence (PACS: the product over the response's tokens, the exact importance weight, but a
    0.5-1 nat bf16 gap over 4k tokens scales a response by 0.37-2.7 with no lag); auto: token for grpo, geometric
    for pacs (docs/algorithm.md §5.1)."""

    @property
    def tis_ratio_level(self) -> str | None:
        """The level of the importance ratios with --off-policy-correction tis (``--tis-level`` resolved), else
        None."""
        if self.off_policy_correction != "tis":
            return None
        if self.tis_level != "auto":
            return self.tis_level
        return "token" if self.loss == "grpo" else "geometric"

    @property
    def needs_reference(self) -> bool:
        """A KL term or the reference anchor needs the reference policy's log-probs."""
        return self.kl_coef > 0 or (self.loss == "pacs" and self.pacs_score_reference == "ref")

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
        if not self.tis_cap > 1:
            raise bad("tis_cap", f"{self.tis_cap} must be > 1 (the ratio is truncated from above at this value)")
        if is_set(self, "tis_cap") and self.off_policy_correction != "tis":
            raise bad("tis_cap", "only means something with --off-policy-correction tis; add that or drop the flag")
        if is_set(self, "tis_level") and self.off_policy_correction != "tis":
            raise bad("tis_level", "only means something with --off-policy-correction tis; add that or drop the flag")
        if self.loss == "pacs" and self.tis_level == "token":
            raise bad("tis_level", "token: a PACS score and loss are per response; use geometric or sequence")
        if self.loss == "grpo" and self.tis_level in ("geometric", "sequence"):
            raise bad("tis_level", f"{self.tis_level}: GRPO weights its tokens by token-level ratios; use token")
        if is_set(self, "kl_estimator") and self.kl_coef == 0:
            raise bad("kl_estimator", "only means something with --kl-coef > 0; add that or drop the flag")
        if self.loss == "grpo":  # PACS's own settings would be ignored
            for name in ("pacs_beta", "pacs_score", "pacs_advantage", "pacs_weights"):
                if is_set(self, name):
                    raise bad(name, "only applies to --loss pacs; it has no meaning for --loss grpo: drop it")
        if self.loss == "pacs" and is_set(self, "clip_ratio"):
            raise bad("clip_ratio", "is GRPO's PPO clip; PACS has no clipped ratio: use --loss grpo or drop it")
        if self.pacs_score_reference == "ref" and self.loss != "pacs":
            raise bad("pacs_score_reference", "anchors the PACS score; it has no meaning for --loss grpo")
        if self.pacs_score_reference == "ref" and self.pacs_score != "log_ratio":
            raise bad("pacs_score_reference", "needs --pacs-score log_ratio (mean_logp has no anchor)")
