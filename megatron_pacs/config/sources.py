"""The registry of rollout sources: a name (``--rollout-source``) -> what the source is and what it can do.

Shaped like :mod:`megatron_pacs.rollout.backends`: this module imports nothing but the standard library, so the
config reads :data:`SOURCES` to check the flag and the flags that only some sources use, and the trainer reads a
source's capabilities on every rank (the sync probe is collective) without building it. A source's module is
imported only when :func:`open_source` builds it.

It lives in the config because the config validates ``--rollout-source`` and the flags a source cannot use against
it (the sources' own package is above the config). A new source: a module under ``sources/`` holding one class that
implements :class:`~megatron_pacs.sources.base.RolloutSource` with an ``open(cfg, *, tokenizer, log_dir, context)``
classmethod, and an entry here. Nothing else names it (tests/config/test_sources.py registers a dummy one).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["SOURCES", "SourceSpec", "open_source", "source_spec"]


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """What a rollout source is, and what it can do."""

    target: str
    """``"module:Class"`` of the source's class (imported only when the source is opened)."""
    engines: bool
    """It generates with inference engines: the weights go into them after every update, the sync probe compares
    them with the trainer, validation and the fleet-only flags (sampling, weight sync, colocation, overlap) apply,
    and the step reports how long engines and trainer waited for each other."""
    engine_logprobs: bool
    """Its rollouts can carry the engines' token log-probs and routing (consistency checks, the off-policy
    correction and router replay need them)."""
    texts: bool = True
    """Its rollouts carry readable records (prompt, response text, ground truth) for the text dumps and
    ``--log-samples``."""
    checked_everywhere: bool = False
    """It is opened on every rank before the models are built, and its ``check(steps)`` refuses bad input there;
    the driver then collects from that same instance. Otherwise only the driver opens it, after the models."""


SOURCES: dict[str, SourceSpec] = {
    "fleet": SourceSpec(target="megatron_pacs.sources.fleet:FleetSource", engines=True, engine_logprobs=True),
    "replay": SourceSpec(
        target="megatron_pacs.sources.replay:ReplaySource",
        engines=False,
        engine_logprobs=True,
        checked_everywhere=True,
    ),
    "synthetic": SourceSpec(
        target="megatron_pacs.sources.synthetic:SyntheticSource", engines=False, engine_logprobs=False, texts=False
    ),
}
"""Source name -> its :class:`SourceSpec`."""


def source_spec(name: str) -> SourceSpec:
    """The spec registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message names ``--rollout-source`` and the choices).
    """
    if name not in SOURCES:
        raise ValueError(f"--rollout-source: unknown rollout source {name!r}; use one of {list(SOURCES)}")
    return SOURCES[name]


def open_source(cfg: Any, *, tokenizer: Any, log_dir: str, context: Any) -> Any:
    """Import and open the source of ``--rollout-source`` (only the fleet's imports Ray, vLLM and math-verify).

    This module imports nothing of the package (the config imports it), so the types are named here, not imported.

    Args:
        cfg: The run's ``TrainConfig``.
        tokenizer: The actor's HF tokenizer.
        log_dir: ``--log-dir`` (the engines' logs).
        context: The run's ``DumpContext`` (tokenizer and vocabulary facts).

    Returns:
        The opened :class:`~megatron_pacs.sources.base.RolloutSource`.
    """
    module, _, cls = source_spec(cfg.source.rollout_source).target.partition(":")
    return getattr(importlib.import_module(module), cls).open(
        cfg, tokenizer=tokenizer, log_dir=log_dir, context=context
    )
