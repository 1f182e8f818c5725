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

    assert OBJECTIVES.names() == ["grpo", "pacs"]
    for name in OBJECTIVES:
        assert isinstance(OBJECTIVES.get(name).build(LossConfig(loss=name), BatchConfig()), Objective)
    assert sorted(CHOICES["pacs_advantage"]) == sorted(ADVANTAGES.names())
    assert sorted(CHOICES["pacs_weights"]) == sorted(WEIGHTS.names())
    assert sorted(CHOICES["pacs_score"]) == sorted(SCORES)
    assert sorted(CHOICES["kl_estimator"]) == sorted(KL_ESTIMATORS)


@pytest.mark.parametrize("field", sorted([*CHOICES, "loss"]))
def test_a_name_outside_the_choices_is_refused_naming_the_flag(field):
    from megatron_pacs.config import LossConfig

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        LossConfig(**{field: "no-such-choice"})
