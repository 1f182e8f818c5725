"""Typed configuration of a training run, and the command line generated from it.

Every field is a flag: ``tensor_model_parallel_size`` is ``--tensor-model-parallel-size`` (Megatron-LM's
spelling where one exists), and the docstring under the field is its ``--help`` text. Validation happens in
``__post_init__`` and in :meth:`TrainConfig.validate`, before any model or engine is built; errors name the flag
and the fix. Imports here stay light (no Megatron, Ray or vLLM) so ``--help`` and ``--dry-run`` are instant.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any, get_type_hints

__all__ = [
    "BatchConfig",
    "LossConfig",
    "ModelConfig",
    "OptimArgs",
    "ParallelArgs",
    "RolloutArgs",
    "RunConfig",
    "TrainConfig",
    "build_parser",
    "parse_config",
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bad(name: str, problem: str) -> ValueError:
    return ValueError(f"{_flag(name)}: {problem}")


@dataclass(kw_only=True)
class ModelConfig:
    """The model."""

    hf_model: str = ""
    """Hugging Face model directory: config, tokenizer and safetensors (the actor starts from these weights)."""
    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights and gradients (GPU)."""
    fp8_format: str | None = None
    """FP8 through Transformer Engine: e4m3 or hybrid (needs --bf16 and Transformer Engine)."""
    fp8_recipe: str = "delayed"
    """Transformer Engine FP8 recipe: delayed, tensorwise, mxfp8 or blockwise."""
    recompute_activations: bool = False
    """Full activation recompute: keep only each layer's input, recompute the rest in the backward pass."""
    transformer_impl: str = "auto"
    """Layer implementation: auto (TE on GPU when importable, else local), te, sdpa or local."""

    def __post_init__(self) -> None:
        if self.fp8_format not in (None, "e4m3", "hybrid"):
            raise _bad("fp8_format", f"{self.fp8_format!r} is not e4m3 or hybrid")
        if self.fp8_format and not self.bf16:
            raise _bad("fp8_format", "FP8 training needs --bf16 as well")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise _bad("fp8_recipe", f"{self.fp8_recipe!r}: use delayed, tensorwise, mxfp8 or blockwise")
        if self.transformer_impl not in ("auto", "te", "sdpa", "local"):
            raise _bad("transformer_impl", f"{self.transformer_impl!r}: use auto, te, sdpa or local")


@dataclass(kw_only=True)
class ParallelArgs:
    """Megatron parallel layout (data parallel size = world / (TP x PP))."""

    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B)."""
    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence across TP ranks."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise _bad(name, "must be >= 1")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise _bad("sequence_parallel", "needs --tensor-model-parallel-size > 1")


@dataclass(kw_only=True)
class BatchConfig:
    """Batch arithmetic; sizes in prompts unless they say responses or tokens."""

    global_batch_size: int = 16
    """Prompts per training step (each sampled --group-size times)."""
    group_size: int = 8
    """Responses per prompt (n)."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step; global-batch-size / ppo-mini-batch-size optimizer steps per epoch."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    micro_batch_size: int = 8
    """Responses per micro-batch (when --max-tokens-per-microbatch is not given)."""
    max_tokens_per_microbatch: int | None = None
    """Token budget per micro-batch (padded rows x length); micro-batches may then split groups."""
    keep_groups_in_microbatch: bool = False
    """Keep whole groups per micro-batch (the reference layout; the loss then runs directly with autograd)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (longer prompts are dropped from the data and counted)."""
    max_response_length: int = 1024
    """Maximum new tokens per response."""
    seq_length: int | None = None
    """Longest prompt + response; default max-prompt-length + max-response-length."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "ppo_mini_batch_size", "ppo_epochs", "micro_batch_size",
                     "max_prompt_length", "max_response_length"):  # fmt: skip
            if getattr(self, name) < 1:
                raise _bad(name, "must be >= 1")
        if self.group_size < 2:
            raise _bad("group_size", "PACS and GRPO compare responses within a group: use >= 2")
        if self.global_batch_size % self.ppo_mini_batch_size:
            raise _bad("ppo_mini_batch_size", f"{self.ppo_mini_batch_size} must divide --global-batch-size "
                                              f"{self.global_batch_size}")  # fmt: skip
        if self.seq_length is None:
            self.seq_length = self.max_prompt_length + self.max_response_length
        if self.seq_length < self.max_prompt_length + self.max_response_length:
            raise _bad("seq_length", f"{self.seq_length} < max-prompt-length + max-response-length; raise it")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < self.seq_length:
            raise _bad("max_tokens_per_microbatch", f"{self.max_tokens_per_microbatch} cannot hold one sequence of "
                                                    f"--seq-length {self.seq_length}; raise it")  # fmt: skip
        if self.keep_groups_in_microbatch and self.micro_batch_size % self.group_size:
            raise _bad("micro_batch_size", f"{self.micro_batch_size} must be a multiple of --group-size "
                                           f"{self.group_size} with --keep-groups-in-microbatch")  # fmt: skip


@dataclass(kw_only=True)
class OptimArgs:
    """AdamW through Megatron's optimizer."""

    lr: float = 1e-6
    """Learning rate (constant after the warm-up; the reference uses 1e-6)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 0.0
    """Global gradient-norm clip; 0 = off (the PACS reference does not clip)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (GPU)."""


@dataclass(kw_only=True)
class LossConfig:
    """The objective."""

    loss: str = "pacs"
    """pacs or grpo."""
    pacs_beta: float = 1.0
    """PACS critic temperature beta."""
    pacs_score: str = "log_ratio"
    """log_ratio (beta * (l - l_old)) or mean_logp (beta * l / L)."""
    pacs_advantage: str = "rloo"
    """Group logit: rloo, grpo, grpo_no_std or naive."""
    pacs_weights: str = "balanced"
    """BCE weights: balanced, none, only_positive or only_negative."""
    clip_ratio: float = 0.2
    """GRPO's PPO clip epsilon."""
    kl_coef: float = 0.0
    """KL penalty to a frozen reference model; reserved: only 0 is accepted until the reference model lands."""

    def __post_init__(self) -> None:
        choices = {"loss": ("pacs", "grpo"), "pacs_score": ("log_ratio", "mean_logp"),
                   "pacs_advantage": ("rloo", "grpo", "grpo_no_std", "naive"),
                   "pacs_weights": ("balanced", "none", "only_positive", "only_negative")}  # fmt: skip
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise _bad(name, f"{getattr(self, name)!r} is not one of {list(valid)}")
        if not self.pacs_beta > 0:
            raise _bad("pacs_beta", "must be > 0")
        if self.kl_coef < 0:
            raise _bad("kl_coef", "must be >= 0")
        if self.kl_coef > 0:
            raise _bad("kl_coef", "the reference-model KL term is not implemented yet; use 0 (the PACS and GRPO "
                                  "recipes of the paper use no KL)")  # fmt: skip


@dataclass(kw_only=True)
class RolloutArgs:
    """The vLLM fleet and sampling."""

    num_engines: int = 1
    """vLLM engines."""
    rollout_tensor_parallel_size: int = 1
    """GPUs per engine."""
    temperature: float = 1.0
    """Sampling temperature (also the temperature of the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    ray_address: str | None = None
    """Existing Ray cluster for the fleet; default: a local one inside --log-dir."""
    colocate: bool = False
    """Engines share the trainer's GPUs (sleep while training)."""
    gpu_memory_utilization: float = 0.6
    """GPU share per engine."""
    rollout_dtype: str = "auto"
    """Engine dtype; auto: the trainer's (bfloat16 with --bf16, else float32)."""
    weight_sync_bucket_mb: int = 256
    """Weight-sync bucket size in MiB."""
    kv_cache_gb: float = 1.0
    """CPU only: KV cache per engine, GiB."""

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise _bad("num_engines", "must be >= 1")
        if self.temperature <= 0:
            raise _bad("temperature", "training rollouts must be sampled: use a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", "must lie in (0, 1]")


@dataclass(kw_only=True)
class RunConfig:
    """Data, length of the run, checkpoints, logging."""

    train_data: list[str] = field(default_factory=list)
    """Prepared training files (.jsonl/.json/.parquet; see tools/prepare_data.py)."""
    val_data: list[str] = field(default_factory=list)
    """Prepared validation files, one data source each."""
    train_iters: int = 10
    """Training steps."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    save: str | None = None
    """Checkpoint directory."""
    load: str | None = None
    """Resume from the latest complete checkpoint here."""
    save_interval: int = 0
    """Steps between checkpoints (0: only at the end when --save is set)."""
    keep_last: int = 2
    """Checkpoints kept."""
    save_hf: bool = False
    """Also write a Hugging Face directory beside every checkpoint."""
    eval_interval: int = 0
    """Steps between validations (0: off); validation also runs before the first step and after the last."""
    val_temperature: float = 0.0
    """Validation sampling temperature: 0 is greedy (the reference); > 0 samples (with --top-p)."""
    val_n: int = 1
    """Validation samples per problem (> 1 needs --val-temperature > 0)."""
    log_dir: str = "runs/default"
    """Metrics, TensorBoard, rollout dumps."""
    wandb_project: str | None = None
    """Weights & Biases project (offline without an account)."""
    wandb_exp_name: str | None = None
    """W&B run name."""
    reward_workers: int = 2
    """math-verify worker processes."""
    reward_timeout: float = 10.0
    """Seconds per response before it scores 0."""
    dry_run: bool = False
    """Validate the configuration, print the layout and memory plan, and exit (no GPUs needed)."""
    world_size: int | None = None
    """With --dry-run: the world size to plan for (default: this launch's)."""

    def __post_init__(self) -> None:
        if self.train_iters < 1:
            raise _bad("train_iters", "must be >= 1")
        if self.keep_last < 1:
            raise _bad("keep_last", "keep at least one checkpoint")
        if self.val_n < 1 or (self.val_n > 1 and self.val_temperature == 0):
            raise _bad("val_n", "use 1 for greedy validation, or set --val-temperature > 0 to sample several")
        if self.save_interval < 0 or self.eval_interval < 0:
            raise _bad("save_interval" if self.save_interval < 0 else "eval_interval", "must be >= 0")


_SECTIONS = {"model": ModelConfig, "parallel": ParallelArgs, "batch": BatchConfig, "optim": OptimArgs,
             "loss": LossConfig, "rollout": RolloutArgs, "run": RunConfig}  # fmt: skip


@dataclass(kw_only=True)
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    """Parallel layout."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batch arithmetic."""
    optim: OptimArgs = field(default_factory=OptimArgs)
    """Optimizer."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Objective."""
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    """Fleet and sampling."""
    run: RunConfig = field(default_factory=RunConfig)
    """Data, checkpoints, logging."""

    def validate(self, world_size: int, *, need_files: bool = True) -> int:
        """Cross-section checks for a given world size; returns the data-parallel size.

        Raises:
            ValueError: naming the flag and the fix.
        """
        p, b = self.parallel, self.batch
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise _bad("tensor_model_parallel_size", f"TP x PP = {model_parallel} must divide the world size "
                                                     f"{world_size}")  # fmt: skip
        dp = world_size // model_parallel
        if b.ppo_mini_batch_size % dp:
            raise _bad("ppo_mini_batch_size", f"{b.ppo_mini_batch_size} prompts must split into whole groups over "
                                              f"{dp} data-parallel ranks; use a multiple of {dp}")  # fmt: skip
        if self.model.fp8_format and not _te_importable():
            raise _bad("fp8_format", "needs Transformer Engine (pip install .[gpu] on a CUDA machine)")
        if not need_files:
            return dp
        if not self.model.hf_model or not os.path.isfile(os.path.join(self.model.hf_model, "config.json")):
            raise _bad("hf_model", f"{self.model.hf_model!r} has no config.json; pass a Hugging Face model directory")
        if not self.run.train_data:
            raise _bad("train_data", "give at least one prepared training file (tools/prepare_data.py)")
        for name in ("train_data", "val_data"):
            for path in getattr(self.run, name):
                if not os.path.isfile(path):
                    raise _bad(name, f"{path} does not exist; prepare it with tools/prepare_data.py")
        if self.run.eval_interval and not self.run.val_data:
            raise _bad("eval_interval", "validation needs --val-data files")
        return dp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@cache
def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its ``--help`` text)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of every section; ``--help`` shows each field's docstring and default."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pacs.train",
        description="PACS / GRPO RLVR training on Megatron-Core with a Ray-managed vLLM fleet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(section, cls.__doc__)
        hints, docs = get_type_hints(cls), _field_docs(cls)
        for f in dataclasses.fields(cls):
            kind, default = hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kwargs: dict[str, Any] = dict(
                dest=f"{section}.{f.name}", help=docs.get(f.name, ""), default=default, metavar=f.name.upper()
            )
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif kind == list[str]:
                kwargs.update(nargs="+", type=str)
            else:
                base = next(t for t in getattr(kind, "__args__", (kind,)) if t is not type(None))
                kwargs["type"] = base
            group.add_argument(_flag(f.name), **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a validated :class:`TrainConfig` (a bad value exits with the flag's error)."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for key, value in ns.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    try:
        return TrainConfig(**{s: cls(**sections[s]) for s, cls in _SECTIONS.items()})
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
