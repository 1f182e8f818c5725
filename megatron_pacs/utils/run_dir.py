"""A run's output folders: the default ``--log-dir``, the checks before anything starts, and a failed write in it.

- The default ``--log-dir`` is one folder per run: ``<--save>/logs`` when ``--save`` is given (a resumed job finds
  its log folder again), else ``runs/run-<UTC time>-<pid>`` (:func:`resolve_log_dir`).
- Before any model, engine or process group exists (:func:`check_outputs`): ``--save`` and ``--log-dir`` must be
  writable, and a ``--log-dir`` that holds another run (metrics of some step, or rollout dumps) is refused unless this
  run resumes that one (``--load`` names a checkpoint that run wrote while logging there).
- A write into ``--log-dir`` that fails (a full disk) raises :class:`LogWriteError`: one line naming the path, the
  step and the OS error (e.g. ``ENOSPC``); the trainer adds what it kept of the step (docs/training.md, "Outputs").
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from megatron_pacs.config import TrainConfig

__all__ = [
    "LogWriteError",
    "any_rank",
    "check_outputs",
    "describe_outputs",
    "log_write",
    "os_error_text",
    "recorded_run",
    "resolve_log_dir",
]

log = get_logger("run_dir")

SAVE_LOGS = "logs"
"""The default ``--log-dir`` under ``--save``."""


def os_error_text(exc: OSError) -> str:
    """``ENOSPC (No space left on device)``: the error's symbolic name and its text."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    text = exc.strerror or str(exc)
    return f"{name} ({text})" if name else text


class LogWriteError(RuntimeError):
    """A write into ``--log-dir`` failed. ``str()`` is the one line the run stops with.

    Attributes:
        path: The file or folder being written.
        step: The training step it belonged to (None outside a step, e.g. at the end of the run).
        error: The OS error.
        outcome: What the run kept of the step (set by the trainer; "" until then).
    """

    def __init__(self, path: str | os.PathLike, step: int | None, error: OSError) -> None:
        super().__init__(str(path))
        self.path, self.step, self.error = Path(path), step, error
        self.outcome = ""

    def __str__(self) -> str:
        when = f"at step {self.step}" if self.step is not None else "at the end of the run"
        line = f"--log-dir: writing {self.path} {when} failed: {os_error_text(self.error)}"
        return f"{line}; {self.outcome}" if self.outcome else line


@contextmanager
def log_write(path: str | os.PathLike, step: int | None) -> Iterator[None]:
    """Turn an ``OSError`` of the writes inside the block into a :class:`LogWriteError` naming ``path`` and ``step``.

    Args:
        path: What the block writes (a file, or the folder of a sink such as ``tensorboard/``).
        step: The step being written (None outside a step).
    """
    try:
        yield
    except LogWriteError:
        raise
    except OSError as exc:
        raise LogWriteError(path, step, exc) from exc


def any_rank(failed: bool) -> bool:
    """Collective where a process group exists: whether any rank's ``failed`` is True (every rank gets the same
    answer); ``failed`` itself without one, or with one rank."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def resolve_log_dir(cfg: TrainConfig, *, world_size: int = 1) -> str:
    """Set ``cfg.run.log_dir`` to its default when it is empty: ``<--save>/logs``, else a fresh
    ``runs/run-<UTC time>-<pid>`` (one process; a multi-process launch uses torchrun's run id, which every rank
    shares). Returns it.

    Raises:
        ValueError: naming ``--log-dir`` for a multi-process launch with neither ``--save`` nor a torchrun run id.
    """
    if cfg.run.log_dir:
        return cfg.run.log_dir
    if cfg.checkpoint.save:
        cfg.run.log_dir = str(Path(cfg.checkpoint.save) / SAVE_LOGS)
    elif world_size == 1:
        cfg.run.log_dir = str(Path("runs") / f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}")
    else:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id in ("", "none"):
            raise ValueError(
                "--log-dir: a multi-process launch without --save needs --log-dir DIR (its ranks cannot agree on a "
                "fresh folder before they connect; torchrun --rdzv-id would name one)"
            )
        cfg.run.log_dir = str(Path("runs") / f"run-{run_id}")
    return cfg.run.log_dir


def recorded_run(log_dir: str | os.PathLike) -> str | None:
    """What ``log_dir`` holds of a run: ``"metrics.jsonl with steps 1-4, 4 rollout dumps"``; None when it holds no
    metric line and no rollout dump (an empty or new folder, or one with only stacks or TensorBoard events)."""
    from megatron_pacs.utils.sinks import METRICS_FILE  # here: sinks imports this module

    root = Path(log_dir)
    found = []
    metrics = root / METRICS_FILE
    if metrics.is_file():
        steps = []
        with open(metrics, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    steps.append(row["step"])
        if steps:
            found.append(f"{metrics.name} with steps {min(steps)}-{max(steps)}")
    dumps = root / "rollouts"
    num_dumps = len({p.name.split(".")[0] for p in dumps.glob("step_*.*")}) if dumps.is_dir() else 0
    if num_dumps:
        found.append(f"rollout dumps of {num_dumps} step(s) in {dumps}")
    return ", ".join(found) or None


def _same_dir(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _resumed_log_dir(cfg: TrainConfig) -> str | None:
    """The ``--log-dir`` the checkpoint that ``--load`` resumes was written with (None: no ``--load``, no checkpoint
    there yet, or a checkpoint without its configuration)."""
    if cfg.checkpoint.load is None:
        return None
    from megatron_pacs.utils.checkpoint_dirs import choose_checkpoint, read_metadata

    ckpt = choose_checkpoint(cfg.checkpoint.load).checkpoint
    if ckpt is None:
        return None
    saved: dict[str, Any] = read_metadata(ckpt).get("config") or {}
    log_dir = (saved.get("run") or {}).get("log_dir")
    return log_dir if isinstance(log_dir, str) and log_dir else None


def _check_writable(path: Path, flag: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(
            f"{flag} {path}: not writable: {os_error_text(exc)}; pass a folder this user can write"
        ) from None


def check_outputs(cfg: TrainConfig) -> None:
    """What ``train.py`` checks of the run's output folders before anything starts (every rank; reads, and creates
    the folders): ``--save`` and ``--log-dir`` writable, and ``--log-dir`` free of another run unless this run
    resumes it (the checkpoint ``--load`` resumes was written by a run logging there).

    Raises:
        ValueError: naming the flag, the folder and, for an occupied ``--log-dir``, what it holds and the way out.
    """
    log_dir = Path(cfg.run.log_dir)
    other = recorded_run(log_dir)
    if other is not None:
        resumed = _resumed_log_dir(cfg)
        if resumed is None or not _same_dir(resumed, log_dir):
            logged = (
                f"; the checkpoint --load resumes logged to {resumed} (pass --log-dir {resumed})" if resumed else ""
            )
            raise ValueError(
                f"--log-dir {log_dir} holds another run ({other}): a fresh run there would mix its steps with that "
                f"run's{logged}; pass a new --log-dir (or leave it out: one folder per run), remove that run, or "
                "resume it with --load pointing at its checkpoints"
            )
    if cfg.checkpoint.save is not None:
        _check_writable(Path(cfg.checkpoint.save), "--save")
    _check_writable(log_dir, "--log-dir")


def describe_outputs(cfg: TrainConfig) -> str:
    """The line a run starts with: where its metrics, rollout dumps and checkpoints go."""
    log_dir = os.path.abspath(cfg.run.log_dir)
    dumps = "rollouts/, " if cfg.run.dump_rollouts else ""
    save = cfg.checkpoint.save
    saves = f"checkpoints to {os.path.abspath(save)}" if save else "no checkpoints (no --save)"
    return f"run: logging to {log_dir} (metrics.jsonl, {dumps}tensorboard/); {saves}"
