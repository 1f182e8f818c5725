"""Where a step's rollouts come from: what every source hands the trainer, and the fleet source.

A source turns a step's prompts into a :class:`StepRollouts` on the driver (rank 0): the packed batch every rank
trains on, the records the rollout dumps keep, and the rollout metrics. :func:`collect_rollouts` is the fleet
source (generate through the engines, score with the reward pool, pack).
"""

from megatron_pacs.sources.fleet import StepRollouts, collect_rollouts

__all__ = ["StepRollouts", "collect_rollouts"]
