"""A new objective is a class, a builder and one registered spec: the config validates ``--loss`` with it, takes its
TIS level, reference need, FP8 score policy and own flags from the spec, ``--help`` lists it, and
``build_objective`` builds it; no ``loss ==`` check elsewhere needs an edit."""

import pytest
import torch

from megatron_pacs.algo.objectives import KLRegularized, MiniBatch, Objective, Prepared, build_objective
from megatron_pacs.algo.token_objectives import GrpoObjective
from megatron_pacs.config import BatchConfig, LossConfig, build_parser, parse_config
from megatron_pacs.config.objectives import OBJECTIVES, ObjectiveSpec


class Dummy(Objective):
    """Sequence-level, whole groups, PPO-clipped like GRPO (it shares ``--clip-ratio``)."""

    loss_key = "dummy/loss"
    old_logprobs = "sequence"
    whole_groups = True

    def __init__(self, loss: LossConfig) -> None:
        self.clip_ratio, self.correction = loss.clip_ratio, loss.tis_ratio_level

    def prepare(self, mb: MiniBatch) -> Prepared:
        return Prepared(lambda tokens: (tokens.logp.sum(), torch.tensor(tokens.num_sequences), {}))


def build_dummy(loss: LossConfig, batch: BatchConfig) -> Objective:
    del batch
    return Dummy(loss)


def _anchored_to_reference(loss: LossConfig) -> bool:
    return loss.tis_ratio_level == "sequence"  # any rule of its own on the loss config


SPEC = ObjectiveSpec(
    title="Dummy",
    builder=f"{__name__}:build_dummy",
    tis_levels=("sequence", "geometric"),
    tis_levels_why="a dummy loss is per response",
    own_flags={"clip_ratio": "is shared by GRPO and Dummy; {title} has no clip: drop it"},
    needs_reference=_anchored_to_reference,
    fp8_scores=True,
)


@pytest.fixture
def dummy():
    """``--loss dummy`` registered for the test only."""
    OBJECTIVES.register("dummy", SPEC)
    try:
        yield "dummy"
    finally:
        OBJECTIVES.unregister("dummy")


def test_a_registered_objective_is_a_loss_choice_and_validates(dummy):
    assert "{pacs,grpo,gspo,cispo,ppo,dummy}" in build_parser().format_help()
    cfg = parse_config(["--loss", dummy, "--clip-ratio", "0.3", "--off-policy-correction", "tis"])
    assert cfg.validate(1, need_files=False) == 1
    assert cfg.loss.tis_ratio_level == "sequence"  # its first level is auto's
    assert cfg.loss.needs_reference  # its own rule
    assert not LossConfig(loss=dummy).needs_reference
    fp8 = ["--bf16", "--fp8-format", "hybrid"]
    assert parse_config([*fp8, "--loss", dummy]).score_fp8 is True  # its FP8 score policy
    assert parse_config(fp8).score_fp8 is False


def test_a_registered_objective_refuses_what_it_does_not_read(dummy):
    with pytest.raises(ValueError, match=r"^--pacs-beta: only applies to --loss pacs; .* for --loss dummy: drop it$"):
        LossConfig(loss=dummy, pacs_beta=2.0)
    with pytest.raises(ValueError, match=r"^--tis-level: token: a dummy loss is per response; use sequence or geo"):
        LossConfig(loss=dummy, off_policy_correction="tis", tis_level="token")
    # a flag two objectives read is refused by the third, with the first owner's reason
    with pytest.raises(
        ValueError,
        match=r"^--clip-ratio: is a setting of the token-level objectives \(grpo, gspo, cispo, ppo\); PACS has none",
    ):
        LossConfig(clip_ratio=0.3)


def test_build_objective_builds_it_through_the_registry(dummy):
    objective = build_objective(LossConfig(loss=dummy), BatchConfig())
    assert isinstance(objective, Dummy) and objective.loss_key == "dummy/loss"
    wrapped = build_objective(LossConfig(loss=dummy, kl_coef=0.1), BatchConfig())
    assert isinstance(wrapped, KLRegularized) and isinstance(wrapped.inner, Dummy)
    assert isinstance(build_objective(LossConfig(loss="grpo"), BatchConfig()), GrpoObjective)


def test_registration_is_undone_cleanly_and_a_name_is_taken_once():
    OBJECTIVES.register("dummy", SPEC)
    with pytest.raises(KeyError, match="already registered"):
        OBJECTIVES.register("dummy", SPEC)
    OBJECTIVES.unregister("dummy")
    assert list(OBJECTIVES) == ["pacs", "grpo", "gspo", "cispo", "ppo"]
    assert "{pacs,grpo,gspo,cispo,ppo}" in build_parser().format_help()
    with pytest.raises(ValueError, match=r"^--loss: 'dummy' is not one of \['pacs', 'grpo', 'gspo', 'cispo', 'ppo'\]$"):
        LossConfig(loss="dummy")
