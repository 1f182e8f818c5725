"""``--help`` stays readable: the rollout flags in groups by concern, every choice flag with its choices, no empty
default shown, no flag's help over 6 lines at an 80-column terminal (the how-to lives in docs/training.md)."""

import argparse
import dataclasses
from typing import get_type_hints

import pytest

from megatron_pacs.config import RolloutConfig, build_parser, sections
from megatron_pacs.config.base import flag

MAX_HELP_LINES = 6
ROLLOUT_GROUPS = ("engines", "sampling", "weight sync", "cluster and faults", "scheduling")


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_rollout_flags_sit_in_groups_by_concern():
    parser = build_parser()
    groups = {g.title: {a.option_strings[0] for a in g._group_actions} for g in parser._action_groups}
    titles = [f"rollout: {name}" for name in ROLLOUT_GROUPS]
    assert all(groups.get(t) for t in titles), sorted(t for t in groups if t)
    assert "rollout" not in groups, "a rollout flag is left out of the groups (give its field a group=)"
    grouped = set().union(*(groups[t] for t in titles))
    assert grouped == {flag(f.name) for f in dataclasses.fields(RolloutConfig)}


def _choice_fields():
    """Every string field that refuses an unknown name by quoting it (``'x' is not one of [...]``, ``'x': use ...``)."""
    for section, cls in sections().items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] not in (str, str | None):
                continue
            try:
                cls(**{f.name: "no-such-choice"})
            except ValueError as exc:
                if "'no-such-choice'" in str(exc):
                    yield section, f.name


def test_every_choice_flag_lists_its_choices():
    fields = list(_choice_fields())
    assert {"loss", "fp8_score_precision", "weight_sync", "rollout_backend"} <= {name for _, name in fields}
    actions = _flag_actions(build_parser())
    for _, name in fields:
        metavar = actions[flag(name)].metavar
        assert isinstance(metavar, str) and metavar.startswith("{"), f"{flag(name)} shows {metavar!r}"


def test_an_empty_or_absent_default_is_not_shown():
    text = build_parser().format_help()
    assert "(default: )" not in text and "(default: None)" not in text and "(default: [])" not in text
    assert "(default: pacs)" in text and "(default: False)" in text


def test_no_help_text_runs_over_six_lines_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    formatter = parser._get_formatter()
    width = formatter._width - formatter._max_help_position  # the help column of a long flag
    assert 50 <= width <= 56
    long = {}
    for name, action in _flag_actions(parser).items():
        lines = formatter._split_lines(formatter._expand_help(action), width)
        if len(lines) > MAX_HELP_LINES:
            long[name] = len(lines)
    assert not long, f"help over {MAX_HELP_LINES} lines (move the how-to to docs/training.md): {long}"


@pytest.mark.parametrize("loss", ["pacs", "grpo"])
def test_the_loss_choices_come_from_the_objective_registry(loss):
    from megatron_pacs.config.objectives import OBJECTIVES

    assert loss in OBJECTIVES
    assert _flag_actions(build_parser())["--loss"].metavar == "{" + ",".join(OBJECTIVES) + "}"
