"""--rollout-source: its own flags, and every fleet-only setting refused with replay and synthetic, naming the flag."""

import pytest

from megatron_pacs.config import parse_config


def _cfg(*argv: str):
    return parse_config(["--hf-model", "m", "--train-data", "d.jsonl", *argv])


def _validate(*argv: str) -> None:
    _cfg(*argv).validate(1, need_files=False)


def test_replay_and_its_folder_go_together():
    with pytest.raises(SystemExit):  # parse_config exits 2 on a bad value, naming the flag
        _cfg("--rollout-source", "replay")
    with pytest.raises(SystemExit):
        _cfg("--replay-from", "run")
    with pytest.raises(SystemExit):
        _cfg("--rollout-source", "fleet", "--synthetic-reward-rate", "0.3")
    assert _cfg("--rollout-source", "replay", "--replay-from", "run").source.replay_from == "run"


@pytest.mark.parametrize(
    "source", [["--rollout-source", "synthetic"], ["--rollout-source", "replay", "--replay-from", "r"]]
)
@pytest.mark.parametrize(
    "flags",
    [
        ["--num-engines", "2"],
        ["--top-p", "0.9"],
        ["--weight-sync", "broadcast"],
        ["--off-policy-steps", "1"],
        ["--reward-workers", "4"],
        ["--eval-interval", "2"],
        ["--rollout-dtype", "bfloat16"],
        ["--rollout-engine-kwargs", '{"enforce_eager": true}'],  # issue 53, item 3: accepted and ignored before
        ["--ray-runtime-env", '{"env_vars": {"A": "1"}}'],
        ["--reward-fn", "math:isclose"],  # any importable two-argument function
    ],
)
def test_fleet_only_settings_are_refused_naming_the_flag(source, flags):
    with pytest.raises(ValueError, match=rf"^{flags[0]}: only a fleet uses it, and --rollout-source {source[1]}"):
        _validate(*source, *flags)


def test_synthetic_rollouts_have_no_text_to_show():
    """Issue 53, item 3: --log-samples was accepted and showed nothing with synthetic rollouts (token ids only); a
    replay's dumps keep the records, so it applies there."""
    with pytest.raises(ValueError, match=r"^--log-samples: shows each step's first responses as text, and "):
        _validate("--rollout-source", "synthetic", "--log-samples", "2")
    _validate("--rollout-source", "replay", "--replay-from", "r", "--log-samples", "2")


def test_synthetic_rollouts_have_no_engine_log_probs_to_compare_or_weight_by():
    with pytest.raises(ValueError, match=r"^--max-logprob-diff: compares with the engines' log-probs"):
        _validate("--rollout-source", "synthetic", "--max-logprob-diff", "0.1")
    with pytest.raises(ValueError, match=r"^--off-policy-correction: weights by the engines' log-probs"):
        _validate("--rollout-source", "synthetic", "--off-policy-correction", "tis")
    # a replay has the recorded engine log-probs: both apply
    _validate("--rollout-source", "replay", "--replay-from", "r", "--max-logprob-diff", "0.1")


def test_the_update_s_own_settings_stay_available():
    _validate("--rollout-source", "synthetic", "--temperature", "0.7", "--kl-coef", "0.01", "--ref-reset-interval", "2")


def test_router_replay_needs_routed_experts_which_synthetic_rollouts_lack():
    """Synthetic rollouts have no routing; a replay's dumps may (each is checked when the replay starts:
    tests/sources/test_dumps.py)."""
    with pytest.raises(ValueError, match=r"^--router-replay: r3 replays .* --rollout-source synthetic rollouts"):
        _validate("--rollout-source", "synthetic", "--router-replay", "r3")
    _validate("--rollout-source", "synthetic", "--router-replay", "off")
    _validate("--rollout-source", "replay", "--replay-from", "r", "--router-replay", "r3")


def test_group_filtering_flags():
    """--filter-groups zero-variance works with the sources that generate; replay (whose dumps are the trained
    batches) and --max-filter-rounds without filtering are refused, naming the flag."""
    cfg = _cfg("--rollout-source", "synthetic", "--filter-groups", "zero-variance", "--max-filter-rounds", "0")
    assert (cfg.source.filter_groups, cfg.source.max_filter_rounds) == ("zero-variance", 0)
    from megatron_pacs.config.source import SourceConfig

    with pytest.raises(ValueError, match=r"^--filter-groups: --rollout-source replay"):
        SourceConfig(rollout_source="replay", replay_from="r", filter_groups="zero-variance")
    with pytest.raises(ValueError, match=r"^--max-filter-rounds: only means something with --filter-groups"):
        SourceConfig(max_filter_rounds=2)
    with pytest.raises(ValueError, match=r"^--max-filter-rounds: -1 must be >= 0"):
        SourceConfig(filter_groups="zero-variance", max_filter_rounds=-1)
    with pytest.raises(SystemExit):  # the command line exits 2, naming the flag
        _cfg("--filter-groups", "all-equal")
