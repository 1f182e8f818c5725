"""Where a step's rollouts come from (``--rollout-source``): the fleet, an earlier run's dumps, or synthetic ones.

A source turns a step's prompts into a :class:`StepRollouts` on the driver (rank 0): the packed batch every rank
trains on, the records the dumps keep, and the rollout metrics. Everything after that (the rollouts' distribution to
the ranks, the update, the weight export, checkpoints, metrics and dumps) is the same code whatever the source.

- :class:`~megatron_pacs.sources.fleet.FleetSource`: the engines generate and the reward pool scores (Ray, vLLM and
  math-verify are imported only when it is built);
- :class:`~megatron_pacs.sources.replay.ReplaySource`: ``--replay-from``'s dumps, bit for bit;
- :class:`~megatron_pacs.sources.synthetic.SyntheticSource`: seeded random sequences, for the training phase alone.

:mod:`megatron_pacs.config.sources` names them and what each can do. Nothing is imported until asked for (the
registry lives in the config, which validates the flag against it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on demand by __getattr__ below
    from megatron_pacs.config.sources import SOURCES, SourceSpec, open_source, source_spec
    from megatron_pacs.sources.base import RolloutSource, StepRollouts, rollout_metrics
    from megatron_pacs.sources.dumps import DumpContext, dump_rollouts, load_dump, tokenizer_fingerprint
    from megatron_pacs.sources.fleet import FleetSource, collect_rollouts
    from megatron_pacs.sources.replay import ReplaySource
    from megatron_pacs.sources.synthetic import SyntheticSource

__all__ = [
    "SOURCES",
    "DumpContext",
    "FleetSource",
    "ReplaySource",
    "RolloutSource",
    "SourceSpec",
    "StepRollouts",
    "SyntheticSource",
    "collect_rollouts",
    "dump_rollouts",
    "load_dump",
    "open_source",
    "rollout_metrics",
    "source_spec",
    "tokenizer_fingerprint",
]

_MODULES = {
    "base": ("RolloutSource", "StepRollouts", "rollout_metrics"),
    "dumps": ("DumpContext", "dump_rollouts", "load_dump", "tokenizer_fingerprint"),
    "fleet": ("FleetSource", "collect_rollouts"),
    "replay": ("ReplaySource",),
    "synthetic": ("SyntheticSource",),
}
_WHERE = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}
_WHERE.update(
    {name: "megatron_pacs.config.sources" for name in ("SOURCES", "SourceSpec", "open_source", "source_spec")}
)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
