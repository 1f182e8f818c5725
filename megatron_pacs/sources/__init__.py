"""Where a step's rollouts come from (``--rollout-source``): the fleet, an earlier run's dumps, or synthetic ones.

A source turns a step's prompts into a :class:`StepRollouts` on the driver (rank 0): the packed batch every rank
trains on, the records the dumps keep, and the rollout metrics. Everything after that (the rollouts' distribution to
the ranks, the update, the weight export, checkpoints, metrics and dumps) is the same code whatever the source.

- :class:`~megatron_pacs.sources.fleet.FleetSource`: the engines generate and the reward pool scores (Ray, vLLM and
  math-verify are imported only when it is built);
- :class:`~megatron_pacs.sources.replay.ReplaySource`: ``--replay-from``'s dumps, bit for bit;
- :class:`~megatron_pacs.sources.synthetic.SyntheticSource`: seeded random sequences, for the training phase alone.
"""

from __future__ import annotations

from typing import Any

from megatron_pacs.config import TrainConfig
from megatron_pacs.sources.base import RolloutSource, StepRollouts, rollout_metrics
from megatron_pacs.sources.dumps import DumpContext, dump_rollouts, load_dump, tokenizer_fingerprint
from megatron_pacs.sources.fleet import FleetSource, collect_rollouts
from megatron_pacs.sources.replay import ReplaySource
from megatron_pacs.sources.synthetic import SyntheticSource

__all__ = [
    "DumpContext",
    "FleetSource",
    "ReplaySource",
    "RolloutSource",
    "StepRollouts",
    "SyntheticSource",
    "build_source",
    "collect_rollouts",
    "dump_rollouts",
    "load_dump",
    "rollout_metrics",
    "tokenizer_fingerprint",
]


def build_source(
    cfg: TrainConfig, tokenizer: Any, log_dir: str, context: DumpContext, replay: ReplaySource | None
) -> RolloutSource:
    """The driver's rollout source for ``--rollout-source`` (only the fleet's imports Ray, vLLM and math-verify).

    Args:
        cfg: The run's configuration.
        tokenizer: The actor's HF tokenizer (the fleet's prompts).
        log_dir: ``--log-dir`` (the engines' logs).
        context: The run's tokenizer and vocabulary facts (the synthetic tokens stay within both).
        replay: The replay source, built and checked on every rank before anything else (``replay`` only).
    """
    kind = cfg.source.rollout_source
    if kind == "fleet":
        return FleetSource(cfg, tokenizer, log_dir)
    if kind == "replay":
        assert replay is not None, "the replay source is built before the models"
        return replay
    return SyntheticSource(cfg, min(context.tokenizer_size, context.vocab_size))
