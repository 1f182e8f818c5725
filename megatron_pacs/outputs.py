"""A run's output folders: the default ``--log-dir`` and the checks before anything starts.

- The default ``--log-dir`` is one folder per run: ``<--save>/logs`` when ``--save`` is given (a resumed job finds
  its log folder again), else ``runs/run-<UTC time>-<pid>`` (:func:`resolve_log_dir`).
- Before any model, engine or process group exists (:func:`check_outputs`): ``--save`` and ``--log-dir`` must be
  writable, and a ``--log-dir`` that holds another run (metrics of some step, or rollout dumps) is refused unless this
  run resumes that one (``--load`` names a checkpoint that run wrote while logging there) or is the same job started
  again before its first checkpoint.
- A failed write into the folder later is :class:`~megatron_pacs.utils.log_writes.LogWriteError`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_pacs.config import TrainConfig
from megatron_pacs.utils.checkpoint_dirs import choose_checkpoint, read_metadata
from megatron_pacs.utils.log_writes import os_error_text
from megatron_pacs.utils.sinks import METRICS_FILE

__all__ = ["SAVE_LOGS", "check_outputs", "describe_outputs", "recorded_run", "resolve_log_dir"]

SAVE_LOGS = "logs"
"""The default ``--log-dir`` under ``--save``."""


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
    ckpt = choose_checkpoint(cfg.checkpoint.load).checkpoint
    if ckpt is None:
        return None
    saved: dict[str, Any] = read_metadata(ckpt).get("config") or {}
    log_dir = (saved.get("run") or {}).get("log_dir")
    return log_dir if isinstance(log_dir, str) and log_dir else None


def _requeued_before_first_checkpoint(cfg: TrainConfig) -> bool:
    """The same job started again (``--load`` and ``--save`` one folder, logging under it) before it saved anything:
    its log folder holds what the first attempt logged, and the steps run again from the start."""
    ck = cfg.checkpoint
    if not (ck.load and ck.save and _same_dir(ck.load, ck.save)):
        return False
    if not _same_dir(cfg.run.log_dir, Path(ck.save) / SAVE_LOGS):
        return False
    return choose_checkpoint(ck.load).checkpoint is None


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
    if other is not None and not _requeued_before_first_checkpoint(cfg):
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
