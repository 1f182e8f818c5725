"""Typed configuration of a run, one dataclass per concern, and the command line generated from it.

Each section lives beside the others here, with no heavy imports, and is what the code that owns the concern takes:
:class:`ParallelConfig` goes to ``mcore.parallel.init_parallel``, :class:`OptimConfig` to ``mcore.optim``,
:class:`RolloutConfig` to the fleet, :class:`LossConfig` to ``algo.objectives``. :class:`TrainConfig` composes them.
Every field is a flag (``--field-name``) whose ``--help`` is the docstring under the field; ``__post_init__``
validates a section and :meth:`TrainConfig.validate` what needs several sections or the world size, before any
model, process group or engine exists. Errors name the flag and the fix.
"""

from megatron_pacs.config.base import bad, flag
from megatron_pacs.config.batch import BatchConfig
from megatron_pacs.config.cli import (
    add_section_flags,
    build_parser,
    field_docs,
    parse_config,
    section_from_args,
    sections,
)
from megatron_pacs.config.loss import LossConfig
from megatron_pacs.config.model import ModelConfig
from megatron_pacs.config.optim import OptimConfig
from megatron_pacs.config.parallel import ParallelConfig
from megatron_pacs.config.reference import ReferenceConfig
from megatron_pacs.config.rollout import RolloutConfig
from megatron_pacs.config.run import CheckpointConfig, DataConfig, EvalConfig, RewardConfig, RunConfig
from megatron_pacs.config.source import SourceConfig
from megatron_pacs.config.train import TrainConfig

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SourceConfig",
    "TrainConfig",
    "add_section_flags",
    "bad",
    "build_parser",
    "field_docs",
    "flag",
    "parse_config",
    "section_from_args",
    "sections",
]
