"""The rollout-source registry: a new source is one class and one entry, and nothing else names it.

Guards that the config validates ``--rollout-source`` against :data:`SOURCES`, that the flags a source cannot use
are refused from what it declares (engines, engine log-probs), and that :func:`open_source` builds the registered
class, so the trainer (which reads only the spec and the source's attributes) needs no edit for a new source.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from megatron_pacs.config import SourceConfig
from megatron_pacs.config.source import check_source_flags
from megatron_pacs.config.sources import SOURCES, SourceSpec, open_source, source_spec
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.sources.base import StepRollouts


class ConstantSource:
    """A dummy source: every response is the same two tokens, rewarded 1."""

    fleet = None
    scorer = None

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.checked: list[int] = []

    @classmethod
    def open(cls, cfg, *, tokenizer, log_dir, context) -> ConstantSource:
        return cls(cfg.batch.group_size)

    def check(self, steps: Sequence[int]) -> None:
        self.checked = list(steps)

    def collect(self, rows, step: int) -> StepRollouts:
        n = len(rows) * self.group_size
        ones = torch.ones(n, dtype=torch.long)
        batch = RolloutBatch.from_sequences([[5, 6, 7]] * n, ones, 2 * ones, torch.ones(n), self.group_size)
        return StepRollouts(batch, prompt_ids=[row.id for row in rows])

    def close(self) -> None:
        pass


@pytest.fixture
def dummy_source():
    SOURCES["constant"] = SourceSpec(target=f"{__name__}:ConstantSource", engines=False, engine_logprobs=False)
    yield SOURCES["constant"]
    del SOURCES["constant"]


def test_a_registered_source_validates_and_opens(dummy_source):
    from megatron_pacs.config import parse_config
    from megatron_pacs.sources.dumps import DumpContext

    cfg = parse_config(["--hf-model", "m", "--train-data", "d", "--rollout-source", "constant", "--group-size", "2"])
    assert cfg.source.rollout_source == "constant"
    assert source_spec("constant") is dummy_source
    context = DumpContext(tokenizer_size=10, tokenizer_sha256="x", vocab_size=10, temperature=1.0)
    source = open_source(cfg, tokenizer=None, log_dir="unused", context=context)
    assert isinstance(source, ConstantSource) and source.group_size == 2
    source.check([1, 2])
    assert source.checked == [1, 2]


def test_an_unregistered_source_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"--rollout-source: 'nope' is not one of \['fleet', 'replay', 'synthetic'\]"):
        SourceConfig(rollout_source="nope")
    with pytest.raises(ValueError, match="--rollout-source: unknown rollout source 'nope'"):
        source_spec("nope")


def test_fleet_only_flags_are_refused_from_what_a_source_declares(dummy_source):
    """A source without engines refuses the engines' flags; one without engine log-probs refuses the correction."""
    from megatron_pacs.config import parse_config

    base = ["--hf-model", "m", "--train-data", "d", "--rollout-source", "constant"]
    for extra, name in (
        (["--top-p", "0.9"], "--top-p"),
        (["--off-policy-correction", "tis"], "--off-policy-correction"),
    ):
        cfg = parse_config([*base, *extra])
        sections = {s: getattr(cfg, s) for s in ("rollout", "loss", "reward", "eval", "data", "model")}
        with pytest.raises(ValueError, match=f"{name}.*constant"):
            check_source_flags(cfg.source, sections)
    cfg = parse_config(base)
    check_source_flags(cfg.source, {s: getattr(cfg, s) for s in ("rollout", "loss", "reward", "eval", "data", "model")})


def test_the_builtin_sources_declare_what_the_trainer_reads():
    assert source_spec("fleet").engines and not source_spec("replay").engines
    assert source_spec("replay").checked_everywhere and source_spec("replay").engine_logprobs
    assert not source_spec("synthetic").engine_logprobs
