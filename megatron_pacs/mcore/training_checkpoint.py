"""A run's resumable state (training checkpoints): model + optimizer (Megatron distributed checkpointing, any layout in
or out), RNG states, step, data position and config; written to a temporary folder and renamed into place only when
complete. What the directory holds is read by :mod:`megatron_pacs.utils.checkpoint_dirs` (no Megatron).

Resuming takes the checkpoint the tracker names, not the highest step. Every checkpoint records its parent (the
checkpoint its run resumed from, or saved before it), so after a rollback (``--load`` of an earlier step) a damaged
newest checkpoint falls back along its own lineage only, ``--keep-last`` counts along that lineage, and the
checkpoints of the branch the rollback left are set aside (renamed ``iter_N.abandoned-<time>``), never loaded nor
deleted. The metadata and the tracker are fsynced before they count. A save only removes its own temporary folder;
one that fails for lack of space or another I/O error raises :class:`CheckpointWriteError` naming the step, the
directory, the OS error and the checkpoint that will resume.

Checkpoints are trusted input: the RNG state loads with ``weights_only=True``, but the driver's pending rollouts
(``pending_rollouts.pt``) are pickled Python objects, so load only checkpoints you or your job wrote.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from megatron_pacs.mcore.checkpoint_fingerprint import CheckpointContentError, FingerprintedLoad, FingerprintedSave
from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.model_checkpoint import META_FILE, _barrier, _rank, apply_model_state, load_distributed
from megatron_pacs.utils.checkpoint_dirs import (
    LINEAGE_FILE,
    TRACKER,
    CheckpointWriteError,
    checkpoint_dir,
    choose_checkpoint,
    complete_checkpoints,
    lineage,
    read_metadata,
    read_parents,
    set_aside,
)
from megatron_pacs.utils.exit_signal import ignore_stop_signals, stop_signals_blocked
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.os_errors import os_error_of

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "TRACKER",
    "CheckpointWriteError",
    "ExtraModel",
    "complete_checkpoints",
    "find_latest_checkpoint",
    "load_training_checkpoint",
    "os_error_of",
    "save_training_checkpoint",
]

log = get_logger("checkpoint")

WRITE_ERRORS = (Exception, CheckpointException)
"""What a failed write raises (torch.distributed.checkpoint's per-rank failures are a BaseException)."""


@dataclass(frozen=True)
class ExtraModel:
    """Chunks kept beside the policy's in a subfolder, with their optimizer when they train (PPO's critic)."""

    models: Sequence[MegatronModule]
    optimizer: Any = None


Extras = Mapping[str, "Sequence[MegatronModule] | ExtraModel"]
"""``extra_models``: name -> chunks (weights only, e.g. the reference) or an :class:`ExtraModel`."""


def _extra(value: Sequence[MegatronModule] | ExtraModel) -> ExtraModel:
    return value if isinstance(value, ExtraModel) else ExtraModel(value)


def _sharded(models: Sequence[MegatronModule], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    model_sd: dict[str, Any] = {}
    for i, m in enumerate(models):
        inner = getattr(m, "module", m)  # DDP wraps the GPTModel
        model_sd["model" if len(models) == 1 else f"model{i}"] = inner.sharded_state_dict()
    merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
    state = dict(model_sd)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=is_loading)
    return state


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint to resume under ``root`` (:func:`~megatron_pacs.utils.checkpoint_dirs.choose_checkpoint`,
    its notes logged as warnings), or None when it holds no complete checkpoint.

    Raises:
        ValueError: naming the file, when the newest checkpoint is damaged and none of its lineage is complete.
    """
    choice = choose_checkpoint(root)
    for note in choice.notes:
        log.warning("%s", note)
    return choice.checkpoint


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_training_checkpoint(
    save: str | os.PathLike,
    step: int,
    models: Sequence[MegatronModule],
    optimizer: Any,
    metadata: dict[str, Any],
    *,
    parent: str | os.PathLike | None = None,
    keep_last: int = 2,
    extra_models: Extras | None = None,
    driver_objects: dict[str, Any] | None = None,
) -> Path:
    """Write ``save/iter_<step>`` atomically (collective: every rank calls it).

    Args:
        save: Checkpoint root.
        step: The training step just completed.
        models: This rank's (DDP-wrapped) chunks.
        optimizer: The Megatron optimizer (its state is sharded like the model).
        metadata: JSON-able run state (step, data position, LR schedule, config); written last by rank 0.
        parent: The checkpoint this state descends from (the one the run resumed from, or saved before this one),
            None (the default) for a run started from scratch; recorded as the new checkpoint's parent (its lineage).
        keep_last: Checkpoints of the new checkpoint's lineage to keep (older ones are deleted after it is in place;
            complete checkpoints off the lineage are set aside, renamed ``<name>.abandoned-<time>``).
        extra_models: Other models to keep with it (name -> chunks, e.g. the reference policy, or an
            :class:`ExtraModel` with its optimizer, PPO's critic), each a sharded checkpoint in a subfolder of that
            name.
        driver_objects: Rank 0's own state (name -> object, e.g. rollouts generated ahead), ``<name>.pt``.

    Raises:
        CheckpointWriteError: when the write fails with an OS error (a full disk, an I/O error); the temporary
            folder is removed and the checkpoints already there are untouched.
    """
    _, tmp = _temp_folder(save, step)
    error = None
    try:
        _write(tmp, models, optimizer, extra_models, driver_objects)
    except WRITE_ERRORS as exc:  # _finish reports an OS error in one line, re-raises any other
        error = exc
    return _finish(save, step, tmp, metadata, parent=parent, keep_last=keep_last, error=error)


def _temp_folder(save: str | os.PathLike, step: int) -> tuple[Path, str]:
    """``step``'s checkpoint folder and the temporary folder it is written into (made by rank 0, on every rank)."""
    final = checkpoint_dir(save, step)
    tmp = None
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    box = [tmp]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    assert tmp is not None, "rank 0 makes the folder and broadcasts its path"
    return final, tmp


def _finish(
    save: str | os.PathLike,
    step: int,
    tmp: str,
    metadata: dict[str, Any],
    *,
    parent: str | os.PathLike | None,
    keep_last: int,
    error: BaseException | None,
    remove: Callable[[Path], None] | None = None,
) -> Path:
    """After every rank's writes into ``tmp`` (``error``: this rank's failure, None when they went through): rank 0
    commits (:func:`_commit`), and its outcome reaches every rank (collective).

    Raises:
        CheckpointWriteError: when a rank's write or the commit failed with an OS error; ``tmp`` is removed.
    """
    final = checkpoint_dir(save, step)
    parent_ref = _parent_ref(final.parent, parent)
    failure: str | None = None
    try:
        if error is not None:
            raise error
        if _rank() == 0:
            world = dist.get_world_size() if dist.is_initialized() else 1
            meta = {**metadata, "step": step, "world_size": world, "written_at": time.time(), "parent": parent_ref}
            _commit(tmp, final, meta, parent_ref, keep_last, remove)
    except WRITE_ERRORS as exc:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename went through
        error = os_error_of(exc, final.parent)
        if error is None:
            _outcome(f"--save: writing step {step}'s checkpoint failed: {type(exc).__name__}: {exc}")
            raise
        failure = _write_failure(save, step, error)
    # rank 0's outcome to every rank, in place of a bare barrier: a commit that fails on rank 0 ends every rank
    # with its message instead of leaving the others waiting for it
    failure = _outcome(failure)
    if failure is not None:
        raise CheckpointWriteError(failure)
    return final


def _commit(
    tmp: str,
    final: Path,
    meta: dict[str, Any],
    parent_ref: str | None,
    keep_last: int,
    remove: Callable[[Path], None] | None = None,
) -> None:
    """Rank 0: the metadata, the rename into place, the lineage, the tracker, then ``--keep-last`` pruning (each
    durable before the next; a stop between any two leaves a directory :func:`find_latest_checkpoint` resumes).
    ``remove`` deletes a pruned checkpoint's renamed folder (default: now)."""
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _record_lineage(final, parent_ref)
    _write_durably(final.parent / TRACKER, f"{meta['step']}\n")
    _prune(final, keep_last, remove or _remove_now)


def _outcome(failure: str | None) -> str | None:
    """Rank 0's failure message (None: the checkpoint is in place) on every rank; the first rank that failed when
    rank 0 did not."""
    if not dist.is_initialized():
        return failure
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, failure)
    return next((f if r == 0 else f"rank {r}: {f}" for r, f in enumerate(box) if f is not None), None)


def _write(
    tmp: str,
    models: Sequence[MegatronModule],
    optimizer: Any,
    extra_models: Extras | None,
    driver_objects: dict[str, Any] | None,
    requests: list[AsyncRequest] | None = None,
) -> None:
    """Every rank's shards, RNG state and (rank 0) driver objects into ``tmp``; with ``requests``, the shards'
    writes are not done but appended there (Megatron's asynchronous requests, to schedule)."""
    background = requests is not None
    _use_write_results_queue(background)
    with cuda_to_cpu():
        parts = [(tmp, _sharded(models, optimizer, is_loading=False))]
        for name, value in (extra_models or {}).items():
            sub = os.path.join(tmp, name)
            if _rank() == 0:
                os.makedirs(sub, exist_ok=True)
            _barrier()
            extra = _extra(value)
            parts.append((sub, _sharded(extra.models, extra.optimizer, is_loading=False)))
        for folder, sharded in parts:
            request = dist_checkpointing.save(sharded, folder, FingerprintedSave(), async_sharded_save=background)
            if requests is not None and request is not None:
                requests.append(request)
    rng = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(rng, os.path.join(tmp, f"rng_rank{_rank():05d}.pt"))
    if _rank() == 0:
        for name, obj in (driver_objects or {}).items():
            torch.save(obj, os.path.join(tmp, f"{name}.pt"))
    _barrier()


_write_results_manager: SyncManager | None = None
_write_results_queue: Any = None  # the manager's queue (a proxy), for the background saves
_in_process_results: queue.Queue = queue.Queue()  # for the synchronous saves


def _use_write_results_queue(background: bool) -> None:
    """Point Megatron's checkpoint writer at the results queue this save needs.

    The writer reports each save's results through a module-level queue (``filesystem_async._results_queue``),
    served by a spawned multiprocessing Manager that Megatron starts at the first save. A synchronous save writes and
    reads its results in this process, so it gets a plain in-process queue: no server. The server had to import
    torch and Megatron to unpickle the results, about 4 s of CPU at each process's first save. A background save
    writes from another process and gets the server's queue (:func:`_start_write_results_queue`). Each writer keeps
    the queue it was given, so a background save still in flight is not affected by the next save's choice.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # hasattr: a Megatron without that module-level queue has no such server to protect (the tests would say so)
    if not hasattr(filesystem_async, "_results_queue"):
        return
    if background:
        _start_write_results_queue()
        filesystem_async._results_queue = _write_results_queue
    else:
        filesystem_async._results_queue = _in_process_results


def _start_write_results_queue() -> None:
    """Serve the background saves' results queue from a process that outlives a scheduler's SIGTERM (once).

    Slurm signals every process of the job step, so a preemption's or a time limit's warning SIGTERM ended the
    server Megatron starts, and the save that ``--exit-signal-handler`` makes next failed with ``[Errno 32] Broken
    pipe``: every stop after the first checkpoint was lost. This starts the server first, ignoring SIGTERM and SIGINT
    and ending with its rank (:func:`~megatron_pacs.utils.exit_signal.ignore_stop_signals`).
    """
    global _write_results_manager, _write_results_queue
    if _write_results_manager is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # spawn, as Megatron's: this process has threads
    # a SIGTERM or Ctrl-C during its start-up must not end it, nor leave it unregistered (its stop at the exit)
    with stop_signals_blocked():
        manager.start(ignore_stop_signals, (os.getpid(),))
        _write_results_manager = manager  # the queue's server lives as long as the manager object
        _write_results_queue = manager.Queue()


def _write_failure(save: str | os.PathLike, step: int, error: OSError) -> str:
    """One line: the step, the directory, the OS error and what resumes instead."""
    try:
        last = choose_checkpoint(save).checkpoint
    except ValueError:
        last = None
    resumes = f"--load {save} resumes from {last}, untouched" if last else "no complete checkpoint there resumes yet"
    return (
        f"--save: writing step {step}'s checkpoint to {save} failed: {error}; its temporary folder is removed and "
        f"{resumes}; free space (or fix the device) and resume"
    )


def _parent_ref(root: Path, parent: str | os.PathLike | None) -> str | None:
    """The parent as recorded: its folder name when it sits in ``root``, else its absolute path."""
    if parent is None:
        return None
    parent = Path(parent)
    inside = os.path.realpath(parent.parent) == os.path.realpath(root)
    return parent.name if inside else str(parent.resolve())


def _record_lineage(final: Path, parent: str | None) -> None:
    """Add ``final``'s parent to the directory's lineage file (entries of folders that are gone dropped)."""
    root = final.parent
    parents = {k: v for k, v in read_parents(root).items() if (root / k).is_dir()}
    parents[final.name] = parent
    _write_durably(root / LINEAGE_FILE, json.dumps(dict(sorted(parents.items())), indent=1) + "\n")


def _remove_now(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _prune(final: Path, keep_last: int, remove: Callable[[Path], None]) -> None:
    """Keep ``keep_last`` complete checkpoints of ``final``'s lineage (the others renamed to a name no resume reads,
    then handed to ``remove``); set aside the complete ones off it."""
    chain = lineage(final.parent, final)
    complete = set(complete_checkpoints(final.parent))
    for old in [p for p in chain if p in complete][keep_last:]:
        # renamed first, to a name no resume reads: a stop half-way through the removal leaves no checkpoint that
        # looks complete with tensors missing (the next start under the run lock removes the rest)
        doomed = old.with_name(f".{old.name}.tmp-pruned")
        shutil.rmtree(doomed, ignore_errors=True)  # one an earlier stop left
        os.replace(old, doomed)
        _fsync_dir(old.parent)
        remove(doomed)
    for other in sorted(complete - set(chain)):
        moved = set_aside(other)
        log.warning(
            "set aside %s as %s: it is off the lineage of %s (a branch a rollback left); it is never loaded, "
            "delete it when you no longer need it",
            other.name,
            moved.name,
            final.name,
        )


def _load_models(ckpt: Path, models: Sequence[MegatronModule], optimizer: Any = None) -> dict[str, Any]:
    """Load the chunks' state (and return the loaded state dict, the optimizer's still to apply)."""
    sharded = _sharded(models, optimizer, is_loading=True)
    try:
        state = load_distributed(sharded, ckpt, FingerprintedLoad())
    except CheckpointContentError:
        raise
    except Exception as exc:  # noqa: BLE001 - Megatron raises several types here
        raise ValueError(f"--load: {ckpt} does not fit this model: {type(exc).__name__}: {exc}") from None
    apply_model_state(models, state, f"--load: {ckpt}")
    return state


def load_training_checkpoint(
    ckpt: str | os.PathLike,
    models: Sequence[MegatronModule],
    optimizer: Any,
    *,
    extra_models: Extras | None = None,
) -> dict:
    """Load model and optimizer state (resharded to this run's layout) and this rank's RNG state.

    Args:
        ckpt: A complete checkpoint folder.
        models: This rank's (DDP-wrapped) chunks.
        optimizer: The Megatron optimizer.
        extra_models: Models saved beside them (name -> chunks or :class:`ExtraModel`), loaded from their
            subfolders (with their optimizer's state when given).

    Returns:
        The checkpoint's metadata.

    Raises:
        ValueError: when the folder is not a complete checkpoint or does not fit the model.
    """
    ckpt = Path(ckpt)
    try:
        metadata = read_metadata(ckpt)
    except ValueError as exc:
        raise ValueError(f"--load: {exc}; point --load at another checkpoint, or at the checkpoint root") from None
    state = _load_models(ckpt, models, optimizer)
    if optimizer is not None:
        with cuda_to_cpu():
            optimizer.load_state_dict(state["optimizer"])
    for name, value in (extra_models or {}).items():
        extra = _extra(value)
        extra_state = _load_models(ckpt / name, extra.models, extra.optimizer)
        if extra.optimizer is not None:
            with cuda_to_cpu():
                extra.optimizer.load_state_dict(extra_state["optimizer"])
    rng_file = ckpt / f"rng_rank{_rank():05d}.pt"
    if rng_file.is_file() and metadata.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1):
        rng = torch.load(rng_file, weights_only=True)  # tensors, ints and tuples: no pickled code runs
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    log.info("resumed from %s (step %s)", ckpt, metadata.get("step"))
    return metadata
