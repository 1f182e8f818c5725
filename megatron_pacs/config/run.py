"""The run around the step: data, length, checkpoints, validation, rewards and logging."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_pacs.config.base import bad, is_set

__all__ = ["MIN_HEARTBEAT_TIMEOUT_S", "CheckpointConfig", "DataConfig", "EvalConfig", "RewardConfig", "RunConfig"]

MIN_HEARTBEAT_TIMEOUT_S = 2.0
"""The shortest --heartbeat-timeout-seconds (a rank is declared lost after 0.4 of it without a beat, and every
rank reads the store every tenth of it)."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompt data."""

    train_data: list[str] = field(default_factory=list)
    """Prepared training files (.jsonl/.json/.parquet; see tools/prepare_data.py)."""
    val_data: list[str] = field(default_factory=list)
    """Prepared validation files, one data source each."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints: model, optimizer, RNG and data position, resharded on load."""

    save: str | None = None
    """Checkpoint directory. One that already holds checkpoints needs --load pointing at it (or at one of its
    checkpoints): a fresh run would overwrite checkpoints of the same step."""
    load: str | None = None
    """Resume from the checkpoint written last in this directory, or from this checkpoint folder. A directory
    without a readable checkpoint is refused, unless it is --save's own or --load-optional is given
    (docs/training.md)."""
    load_optional: bool = False
    """With --load: a directory that does not exist, holds no checkpoint yet, or holds only damaged ones starts
    from --hf-model instead of being refused."""
    allow_changed_rows: bool = False
    """With --load: resume although rows of --train-data changed content since the checkpoint (same ids, same
    order; e.g. a corrected answer). Without it such a resume is refused: the record would not say what was
    trained on."""
    save_interval: int = 0
    """Steps between checkpoints (0: only at the end when --save is set)."""
    keep_last: int = 2
    """Checkpoints kept."""
    save_hf: bool = False
    """Also write a Hugging Face directory beside every checkpoint."""
    async_save: bool = False
    """Write the checkpoint's shards in the background while training goes on (Megatron-Core's asynchronous
    checkpointing); it appears under --save once every rank's writes are done (docs/training.md)."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise bad("keep_last", "keep at least one checkpoint")
        if self.save_interval < 0:
            raise bad("save_interval", "must be >= 0")
        if self.save is None:  # nothing is saved: these would be ignored
            for name in ("save_interval", "keep_last", "save_hf", "async_save"):
                if is_set(self, name):
                    raise bad(name, "only applies with --save DIR; add it or drop this flag")
        for name in ("load_optional", "allow_changed_rows"):
            if getattr(self, name) and self.load is None:
                raise bad(name, "only applies with --load DIR; add it or drop this flag")


@dataclass(kw_only=True)
class EvalConfig:
    """Validation during training."""

    eval_interval: int = 0
    """Steps between validations (0: off); validation also runs before the first step and after the last."""
    val_temperature: float = 0.0
    """Validation sampling temperature: 0 is greedy (the reference); > 0 samples (with --top-p)."""
    val_n: int = 1
    """Validation samples per problem (> 1 needs --val-temperature > 0)."""

    def __post_init__(self) -> None:
        if self.eval_interval < 0:
            raise bad("eval_interval", "must be >= 0")
        if not self.eval_interval:  # validation is off: these would be ignored
            for name in ("val_temperature", "val_n"):
                if is_set(self, name):
                    raise bad(name, "only applies with --eval-interval N (validation is off); add it or drop this flag")
        if self.val_n < 1 or (self.val_n > 1 and self.val_temperature == 0):
            raise bad("val_n", "use 1 for greedy validation, or set --val-temperature > 0 to sample several")


@dataclass(kw_only=True)
class RewardConfig:
    """The reward and the worker pool that computes it."""

    reward_fn: str | None = None
    """Your reward in place of math-verify's: module:function or path/to/file.py:function, called as fn(response:
    str, ground_truth: str) -> float in [0, 1] in the reward workers (docs/training.md)."""
    reward_workers: int = 2
    """Reward worker processes."""
    reward_timeout: float = 10.0
    """Seconds per response before it scores 0."""
    reward_max_chars: int = 100_000
    """Responses longer than this many characters score 0 unparsed and are counted (reward/num_too_long); 0: no
    cap. The default is far above any 4,096-token response and stops megabyte inputs early."""

    def __post_init__(self) -> None:
        if self.reward_workers < 1:
            raise bad("reward_workers", "must be >= 1")
        if not self.reward_timeout > 0:
            raise bad("reward_timeout", "must be > 0")
        if self.reward_max_chars < 0:
            raise bad("reward_max_chars", "must be >= 0 (0: no cap)")
        if self.reward_fn is not None:  # imported here: a typo is refused before anything starts
            from megatron_pacs.config.reward_fn import load_reward_fn

            try:
                load_reward_fn(self.reward_fn)
            except ValueError as exc:
                raise bad("reward_fn", str(exc)) from None


@dataclass(kw_only=True)
class RunConfig:
    """Length of the run, seed, logging and the dry run."""

    train_iters: int = 10
    """Training steps."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    log_dir: str = ""
    """Metrics, TensorBoard, rollout dumps: one folder per run. Default: <--save>/logs with --save (a resume finds it
    again), else a new runs/run-<UTC time>-<pid>; the run prints it at the start. One that holds another run is
    refused unless this run resumes it (docs/training.md, "Outputs")."""
    dump_rollouts: bool = True
    """Write every step's rollouts to --log-dir/rollouts/: step_N.jsonl to read and step_N.safetensors to replay
    (about 105 MB a step at recipe scale; docs/training.md); --no-dump-rollouts skips both."""
    wandb_project: str | None = None
    """Weights & Biases project (offline without an account)."""
    wandb_exp_name: str | None = None
    """W&B run name."""
    log_samples: int = 0
    """Generations (prompt, response, ground truth, reward) recorded per step in TensorBoard (text) and W&B (a
    table): the step's first N responses; 0: none (every response is in --log-dir/rollouts/ anyway)."""
    dry_run: bool = False
    """Validate the configuration, print the layout and memory plan, and exit (no GPUs needed)."""
    world_size: int | None = None
    """With --dry-run: the world size to plan for (default: this launch's)."""
    exit_signal_handler: bool = False
    """On SIGTERM (a scheduler's preemption notice), stop at the next step boundary, save a checkpoint when --save
    is set and exit 0, as Megatron-LM's flag; see --exit-signal-grace-seconds."""
    exit_signal_grace_seconds: float = 60.0
    """With --exit-signal-handler: seconds from SIGTERM to exit (the step in progress, then the checkpoint); set it
    below the scheduler's kill delay (Slurm's KillWait)."""
    heartbeat_timeout_seconds: float = 60.0
    """Seconds after a training rank's heartbeat stops (its host lost, its process stopped) before every other rank
    logs it, writes its threads' stacks to --log-dir/stacks/ and exits 1; 0: off (docs/training.md)."""

    def __post_init__(self) -> None:
        if self.train_iters < 1:
            raise bad("train_iters", "must be >= 1")
        if self.seed < 0:
            raise bad("seed", "must be >= 0 (every random stream is derived from it by numpy's SeedSequence)")
        if not self.exit_signal_grace_seconds > 0:
            raise bad("exit_signal_grace_seconds", "must be > 0")
        if is_set(self, "exit_signal_grace_seconds") and not self.exit_signal_handler:
            raise bad("exit_signal_grace_seconds", "only applies with --exit-signal-handler; add it or drop this flag")
        hb = self.heartbeat_timeout_seconds
        if hb != 0 and not hb >= MIN_HEARTBEAT_TIMEOUT_S:
            raise bad("heartbeat_timeout_seconds", f"{hb:g} must be 0 (off) or >= {MIN_HEARTBEAT_TIMEOUT_S:g}")
        if self.world_size is not None and self.world_size < 1:
            raise bad("world_size", "must be >= 1")
        if self.world_size is not None and not self.dry_run:
            raise bad("world_size", "only applies with --dry-run (a launch's world size is its own); drop it")
        if self.log_samples < 0:
            raise bad("log_samples", f"{self.log_samples} must be >= 0 (0: none)")
        if self.wandb_exp_name is not None and self.wandb_project is None:
            raise bad("wandb_exp_name", "only applies with --wandb-project; add it or drop this flag")
