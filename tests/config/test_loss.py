"""The loss choices the CLI offers are exactly what the algorithm package registers.

``config/`` imports nothing heavy (``--help`` and the dry run stay instant), so ``config/loss.py:CHOICES`` spells
the names out instead of importing the registries of ``algo/``; this test keeps the two in step. The objectives'
names come from their own registry (``config/objectives.py``), whose builders this test imports.
"""

import pytest

from megatron_pacs.config.loss import CHOICES


def test_every_registered_name_is_a_cli_choice_and_nothing_else():
    from megatron_pacs.algo.kl import KL_ESTIMATORS
    from megatron_pacs.algo.objectives import Objective
    from megatron_pacs.algo.pacs import ADVANTAGES, SCORES, WEIGHTS
    from megatron_pacs.config import BatchConfig, LossConfig
    from megatron_pacs.config.objectives import OBJECTIVES

    from megatron_pacs.algo.advantages import ADVANTAGE_ESTIMATORS
    from megatron_pacs.algo.policy_losses import AGG_MODES

    assert OBJECTIVES.names() == ["cispo", "grpo", "gspo", "pacs"]
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
