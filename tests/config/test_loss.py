"""The loss choices the CLI offers are exactly what the algorithm package registers.

``config/`` imports nothing heavy (``--help`` and the dry run stay instant), so ``config/loss.py:CHOICES`` spells
the names out instead of importing the registries of ``algo/``; this test keeps the two in step. The objectives'
names come from their own registry (``config/objectives.py``), whose builders this test imports.
"""

import pytest

from megatron_pacs.config.loss import CHOICES


def test_every_registered_name_is_a_cli_choice_and_nothing_else():
    from megatron_pacs.algo.advantages import ADVANTAGE_ESTIMATORS
    from megatron_pacs.algo.kl import KL_ESTIMATORS
    from megatron_pacs.algo.objectives import Objective
    from megatron_pacs.algo.pacs import ADVANTAGES, SCORES, WEIGHTS
    from megatron_pacs.algo.policy_losses import AGG_MODES
    from megatron_pacs.config import BatchConfig, LossConfig
    from megatron_pacs.config.objectives import OBJECTIVES

    assert OBJECTIVES.names() == ["cispo", "grpo", "gspo", "pacs", "ppo"]
    for name in OBJECTIVES:
        assert isinstance(OBJECTIVES.get(name).build(LossConfig(loss=name), BatchConfig()), Objective)
    assert sorted(CHOICES["pacs_advantage"]) == sorted(ADVANTAGES.names())
    assert sorted(CHOICES["pacs_weights"]) == sorted(WEIGHTS.names())
    assert sorted(CHOICES["pacs_score"]) == sorted(SCORES)
    assert sorted(CHOICES["kl_estimator"]) == sorted(KL_ESTIMATORS)
    assert CHOICES["loss_agg_mode"] == ("auto", *AGG_MODES)
    assert CHOICES["advantage_estimator"] == ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("field", sorted([*CHOICES, "loss"]))
def test_a_name_outside_the_choices_is_refused_naming_the_flag(field):
    from megatron_pacs.config import LossConfig

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        LossConfig(**{field: "no-such-choice"})


def test_tis_bounds_and_mode_are_refused_naming_the_flag():
    """--tis-mode/--tis-low/--tis-high/--tis-cap need --off-policy-correction tis; --tis-cap is --tis-high's older
    name (the same value is accepted, another one refused); the bounds keep an on-policy ratio of 1 inside."""
    from megatron_pacs.config.loss import LossConfig

    tis = {"off_policy_correction": "tis"}
    for name, value in (("tis_mode", "mask"), ("tis_low", 0.5), ("tis_high", 3.0), ("tis_cap", 3.0)):
        with pytest.raises(ValueError, match=rf"^--{name.replace('_', '-')}: only means something with --off-policy"):
            LossConfig(**{name: value})
    assert LossConfig(**tis, tis_cap=3.0).tis_high == 3.0
    assert LossConfig(**tis, tis_cap=3.0, tis_high=3.0).tis_high == 3.0
    with pytest.raises(ValueError, match=r"^--tis-cap: 3.0 contradicts --tis-high 4.0"):
        LossConfig(**tis, tis_cap=3.0, tis_high=4.0)
    for bad, flag in (({"tis_high": 1.0}, "--tis-high"), ({"tis_cap": 0.5}, "--tis-cap")):
        with pytest.raises(ValueError, match=rf"^{flag}: .* must be > 1"):
            LossConfig(**tis, **bad)
    for low in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"^--tis-low: .* must lie in \[0, 1\)"):
            LossConfig(**tis, tis_low=low)
    cfg = LossConfig(**tis, tis_mode="mask", tis_low=0.5, tis_high=2.0)
    assert (cfg.tis_mode, cfg.tis_low, cfg.tis_high) == ("mask", 0.5, 2.0)


def test_token_level_flags_are_refused_where_they_mean_nothing_naming_both_flags():
    """--advantage-estimator is the token-level objectives' (PACS has --pacs-advantage); --no-norm-adv-by-std is
    grpo's estimator's; the dual clip is GRPO's and PPO's; shaping needs its buffer; the bounds keep a ratio of 1; PPO
    takes the token-level settings but not the group advantage's (its advantages are GAE's)."""
    from megatron_pacs.config import LossConfig

    with pytest.raises(ValueError, match=r"^--advantage-estimator: .*--loss pacs has its own \(PACS: --pacs-advantage"):
        LossConfig(advantage_estimator="rloo")
    with pytest.raises(ValueError, match=r"^--loss-agg-mode: is a setting of the token-level objectives"):
        LossConfig(loss_agg_mode="token-mean")
    with pytest.raises(
        ValueError, match=r"^--norm-adv-by-std: --no-norm-adv-by-std only .* --advantage-estimator rloo"
    ):
        LossConfig(loss="grpo", advantage_estimator="rloo", norm_adv_by_std=False)
    with pytest.raises(ValueError, match=r"^--clip-ratio-c: is the dual clip of grpo and ppo; GSPO has none"):
        LossConfig(loss="gspo", clip_ratio_c=2.0)
    with pytest.raises(ValueError, match=r"^--advantage-estimator: .*PPO: GAE over its critic"):
        LossConfig(loss="ppo", advantage_estimator="rloo")
    with pytest.raises(ValueError, match=r"^--overlong-buffer-len: shapes the group advantages .*PPO has none"):
        LossConfig(loss="ppo", overlong_buffer_len=16)
    ppo = LossConfig(loss="ppo", clip_ratio_high=0.28, loss_agg_mode="token-mean", entropy_coef=0.001)
    assert (ppo.clip_low, ppo.clip_high, ppo.agg_mode, ppo.clip_ratio_c) == (0.2, 0.28, "token-mean", 3.0)
    with pytest.raises(ValueError, match=r"^--clip-ratio-c: 1.0 must be > 1"):
        LossConfig(loss="grpo", clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"^--clip-ratio-low: 1.5 must lie in \(0, 1\]"):
        LossConfig(loss="grpo", clip_ratio_low=1.5)
    with pytest.raises(ValueError, match=r"^--overlong-penalty-factor: only means something with --overlong-buffer"):
        LossConfig(loss="grpo", overlong_penalty_factor=0.5)
    cfg = LossConfig(loss="cispo", clip_ratio=0.3, clip_ratio_high=5.0)
    assert (cfg.clip_low, cfg.clip_high, cfg.agg_mode) == (0.3, 5.0, "token-mean")
    assert LossConfig(loss="gspo", loss_agg_mode="token-mean").agg_mode == "token-mean"


def test_overlong_buffer_must_fit_in_the_response_length():
    from megatron_pacs.config.cli import parse_config

    cfg = parse_config(["--loss", "grpo", "--overlong-buffer-len", "64", "--max-response-length", "64"])
    with pytest.raises(ValueError, match=r"^--overlong-buffer-len: 64 must be < --max-response-length 64"):
        cfg.validate(1, need_files=False)
