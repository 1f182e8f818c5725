"""The objective: PACS (the default) or the GRPO baseline, and their hyper-parameters (docs/algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad, is_set, option
from megatron_pacs.config.objectives import OBJECTIVES

__all__ = ["LossConfig"]

# The names algo/ registers (advantages, weights, scores, KL estimators), spelled out so that config/ imports
# nothing heavy; tests/config/test_loss.py proves they agree. The objectives come from their registry.
CHOICES = {
    "pacs_score": ("log_ratio", "mean_logp"),
    "pacs_score_reference": ("old", "ref"),
    "kl_estimator": ("k1", "k2", "k3", "k3+"),
    "off_policy_correction": ("none", "tis"),
    "tis_level": ("auto", "token", "geometric", "sequence"),
    "tis_mode": ("truncate", "mask"),
    "pacs_advantage": ("rloo", "grpo", "grpo_no_std", "naive"),
    "pacs_weights": ("balanced", "none", "only_positive", "only_negative"),
    "loss_agg_mode": ("auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "advantage_estimator": ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo"),
}


@dataclass(kw_only=True)
class LossConfig:
    """The objective."""

    loss: str = option("pacs", choices=OBJECTIVES)
    """The objective, a name registered in megatron_pacs/config/objectives.py."""
    pacs_beta: float = 1.0
    """PACS critic temperature beta."""
    pacs_score: str = option("log_ratio", choices=CHOICES["pacs_score"])
    """log_ratio (beta * (l - l_anchor)) or mean_logp (beta * l / L)."""
    pacs_score_reference: str = option("old", choices=CHOICES["pacs_score_reference"])
    """The log_ratio anchor: old (the rollout policy, as the released code) or ref (the frozen reference policy,
    PACS v2)."""
    pacs_advantage: str = option("rloo", choices=CHOICES["pacs_advantage"])
    """Group logit: rloo, grpo, grpo_no_std or naive."""
    pacs_weights: str = option("balanced", choices=CHOICES["pacs_weights"])
    """BCE weights: balanced, none, only_positive or only_negative."""
    clip_ratio: float = 0.2
    """The token-level objectives' clip epsilon (both sides unless --clip-ratio-low / --clip-ratio-high)."""
    clip_ratio_low: float | None = None
    """The lower clip, ratio >= 1 - clip-ratio-low, in (0, 1] (default --clip-ratio)."""
    clip_ratio_high: float | None = None
    """The upper clip, ratio <= 1 + clip-ratio-high (default --clip-ratio; DAPO's clip-higher: 0.28)."""
    clip_ratio_c: float = 3.0
    """GRPO's dual clip: the token loss of a negative advantage is at most -A * clip-ratio-c (> 1; verl's 3.0)."""
    loss_agg_mode: str = option("auto", choices=CHOICES["loss_agg_mode"])
    """The token-level objectives' aggregation over the mini-batch, verl's agg_loss; auto: the objective's (grpo
    seq-mean-token-sum-norm, gspo seq-mean-token-mean, cispo token-mean); docs/algorithm.md §6.1."""
    advantage_estimator: str = option("grpo", choices=CHOICES["advantage_estimator"])
    """The token-level objectives' outcome advantage: grpo, rloo, reinforce_plus_plus_baseline or opo
    (docs/algorithm.md §6.2); PACS has --pacs-advantage."""
    norm_adv_by_std: bool = True
    """--advantage-estimator grpo: divide by the group's reward std (--no-norm-adv-by-std: Dr. GRPO)."""
    overlong_buffer_len: int = 0
    """DAPO's overlong shaping: the reward falls linearly by up to --overlong-penalty-factor over the last this
    many tokens before --max-response-length (0: off)."""
    overlong_penalty_factor: float = 1.0
    """With --overlong-buffer-len: the penalty at --max-response-length."""
    entropy_coef: float = 0.0
    """The token-level objectives' entropy bonus: minus this times the tokens' entropy, aggregated as the loss
    (--loss-agg-mode), is added to the loss (verl's entropy_coeff; 0: none; actor/entropy is reported anyway)."""
    mask_truncated: bool = False
    """Keep responses that reach --max-response-length (truncated) out of the loss and its normaliser (their
    rewards still enter their group's advantages)."""
    kl_coef: float = 0.0
    """KL penalty to the frozen reference policy: kl-coef x mean over responses of (sum of per-token estimates) /
    --max-response-length, added to the loss (0: none; a reference is then built only for the ref anchor)."""
    kl_estimator: str = option("k3", choices=CHOICES["kl_estimator"])
    """Per-token KL estimator, r = log pi_ref - log pi: k1 (-r), k2 (r^2 / 2), k3 (exp(r) - r - 1, its gradient that
    of the reverse KL) or k3+ (k3's value, k2's gradient); docs/algorithm.md §2.7."""

    off_policy_correction: str = option("none", choices=CHOICES["off_policy_correction"])
    """none, or tis: weight each response (PACS) or token (GRPO) by its importance ratio pi_anchor / pi_behaviour,
    truncated or masked to [--tis-low, --tis-high] (--tis-mode), the behaviour being the engines' log-probs
    (docs/algorithm.md §5.1)."""
    tis_mode: str = option("truncate", choices=CHOICES["tis_mode"])
    """With --off-policy-correction tis: truncate (clip the ratio into [--tis-low, --tis-high]) or mask (0 outside
    it: no gradient of its own, still in the normaliser); docs/training.md."""
    tis_high: float = 2.0
    """With --off-policy-correction tis: the upper bound of the importance ratio (> 1)."""
    tis_low: float = 0.0
    """With --off-policy-correction tis: the lower bound of the importance ratio, in [0, 1) (0: none from below)."""
    tis_cap: float | None = None
    """The older name of --tis-high, still accepted (give one of the two)."""
    tis_level: str = option("auto", choices=CHOICES["tis_level"])
    """What one --off-policy-correction tis ratio covers: token (GRPO), geometric (PACS: the per-token geometric
    mean, whose bias does not grow with the length) or sequence (PACS: the exact product); auto: the objective's
    default (docs/algorithm.md §5.1)."""

    @property
    def tis_ratio_level(self) -> str | None:
        """The level of the importance ratios with --off-policy-correction tis (``--tis-level`` resolved), else
        None."""
        if self.off_policy_correction != "tis":
            return None
        if self.tis_level != "auto":
            return self.tis_level
        return OBJECTIVES.get(self.loss).tis_levels[0]

    @property
    def agg_mode(self) -> str:
        """``--loss-agg-mode`` resolved (``auto``: the objective's)."""
        if self.loss_agg_mode != "auto":
            return self.loss_agg_mode
        return OBJECTIVES.get(self.loss).loss_agg_mode or "seq-mean-token-sum-norm"

    @property
    def clip_low(self) -> float:
        """The lower clip epsilon (``--clip-ratio-low``, default ``--clip-ratio``)."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon (``--clip-ratio-high``, default ``--clip-ratio``)."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def needs_reference(self) -> bool:
        """A KL term or the objective (e.g. PACS's reference anchor) needs the reference policy's log-probs."""
        return self.kl_coef > 0 or OBJECTIVES.get(self.loss).needs_reference(self)

    def __post_init__(self) -> None:
        if self.loss not in OBJECTIVES:
            raise bad("loss", f"{self.loss!r} is not one of {list(OBJECTIVES)}")
        spec = OBJECTIVES.get(self.loss)
        for name, valid in CHOICES.items():
            if getattr(self, name) not in valid:
                raise bad(name, f"{getattr(self, name)!r} is not one of {list(valid)}")
        if not self.pacs_beta > 0:
            raise bad("pacs_beta", "must be > 0")
        if not 0 < self.clip_ratio < 1:
            raise bad("clip_ratio", f"{self.clip_ratio} must lie in (0, 1); PPO's usual value is 0.2")
        if self.kl_coef < 0:
            raise bad("kl_coef", "must be >= 0")
        self._check_token_level()
        self._check_tis_bounds()
        if self.tis_level != "auto" and self.tis_level not in spec.tis_levels:
            levels = " or ".join(spec.tis_levels)
            raise bad("tis_level", f"{self.tis_level}: {spec.tis_levels_why}; use {levels}")
        if is_set(self, "kl_estimator") and self.kl_coef == 0:
            raise bad("kl_estimator", "only means something with --kl-coef > 0; add that or drop the flag")
        for other in OBJECTIVES:  # another objective's own settings would be ignored
            for name, problem in OBJECTIVES.get(other).own_flags.items():
                if other != self.loss and name not in spec.own_flags and is_set(self, name):
                    raise bad(name, problem.format(loss=self.loss, title=spec.title))
        if self.pacs_score_reference == "ref" and self.pacs_score != "log_ratio":
            raise bad("pacs_score_reference", "needs --pacs-score log_ratio (mean_logp has no anchor)")

    def _check_token_level(self) -> None:
        """The token-level objectives' clip, estimator and shaping flags."""
        if self.clip_ratio_low is not None and not 0 < self.clip_ratio_low <= 1:
            raise bad("clip_ratio_low", f"{self.clip_ratio_low} must lie in (0, 1] (the ratio's floor is 1 - it)")
        if self.clip_ratio_high is not None and not self.clip_ratio_high > 0:
            raise bad("clip_ratio_high", f"{self.clip_ratio_high} must be > 0 (DAPO's clip-higher is 0.28)")
        if not self.clip_ratio_c > 1:
            raise bad("clip_ratio_c", f"{self.clip_ratio_c} must be > 1 (the dual clip bounds -A * ratio; verl: 3.0)")
        if not self.norm_adv_by_std and self.advantage_estimator != "grpo":
            raise bad(
                "norm_adv_by_std",
                f"--no-norm-adv-by-std only applies to --advantage-estimator grpo; "
                f"--advantage-estimator {self.advantage_estimator} does not divide by a group std: drop one",
            )
        if self.entropy_coef < 0:
            raise bad("entropy_coef", "must be >= 0 (the bonus rewards entropy; 0: none)")
        if self.overlong_buffer_len < 0:
            raise bad("overlong_buffer_len", "must be >= 0 (0: no overlong shaping)")
        if is_set(self, "overlong_penalty_factor") and self.overlong_buffer_len == 0:
            raise bad(
                "overlong_penalty_factor", "only means something with --overlong-buffer-len > 0; add it or drop this"
            )
        if self.overlong_penalty_factor < 0:
            raise bad("overlong_penalty_factor", "must be >= 0")

    def _check_tis_bounds(self) -> None:
        """The importance-ratio flags: only with tis, --tis-cap as --tis-high, 0 <= --tis-low < 1 < --tis-high."""
        for name in ("tis_mode", "tis_high", "tis_low", "tis_cap", "tis_level"):
            if is_set(self, name) and self.off_policy_correction != "tis":
                raise bad(name, "only means something with --off-policy-correction tis; add that or drop the flag")
        if self.tis_cap is not None:
            if is_set(self, "tis_high") and self.tis_high != self.tis_cap:
                raise bad(
                    "tis_cap",
                    f"{self.tis_cap} contradicts --tis-high {self.tis_high}: --tis-cap is the older name of "
                    "--tis-high; give one of the two",
                )
            self.tis_high = self.tis_cap
        if not self.tis_high > 1:
            name = "tis_cap" if self.tis_cap is not None else "tis_high"
            raise bad(name, f"{self.tis_high} must be > 1 (an on-policy ratio of 1 must stay within the bounds)")
        if not 0 <= self.tis_low < 1:
            raise bad(
                "tis_low", f"{self.tis_low} must lie in [0, 1) (an on-policy ratio of 1 must stay within the bounds)"
            )
