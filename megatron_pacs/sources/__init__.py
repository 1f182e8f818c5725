"""Where a step's rollouts come from (``--rollout-source``): the fleet, an earlier run's dumps, or synthetic ones.

A source turns a step's prompts into a :class:`StepRollouts` on the driver (rank 0): the packed batch every rank
trains on, the records the dumps keep, and the rollout metrics. Everything after that (the rollouts' distribution to
the ranks, the update, the weight export, checkpoints, metrics and dumps) is the same code whatever the source.

- :class:`~megatron_pacs.sources.fleet.FleetSource`: the engines generate and the reward pool scores (Ray, vLLM and
  math-verify are imported only when it is built);
- :class:`~megatron_pacs.sources.replay.ReplaySource`: ``--replay-from``'s dumps, bit for bit;
- :class:`~megatron_pacs.sources.synthetic.SyntheticSource`: seeded random sequences, for the training phase alone.
"""

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
    "collect_rollouts",
    "dump_rollouts",
    "load_dump",
    "rollout_metrics",
    "tokenizer_fingerprint",
]
