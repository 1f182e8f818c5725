"""A run's resumable state (training checkpoints): model + optimizer (Megatron distributed checkpointing, any layout in
or out), RNG states, step, data position and config; written to a temporary folder and renamed into place only when
complete.

Layout under ``--save``::

    iter_0000020/                    a complete checkpoint (megatron_pacs.json written last, then the folder renamed)
    .iter_0000040.tmp-XXXX/          an interrupted write: never loaded, removed by the next save
    latest_checkpointed_iteration.txt  the step written last (Megatron-LM's and verl's tracker file)

Resuming takes the checkpoint the tracker names, not the highest step: after a rollback (``--load`` of an earlier
step) the new branch's checkpoints are the ones written last, and ``--keep-last`` deletes in write order, so the
diverged branch goes first. The metadata and the tracker are fsynced before they count. A tracker that is missing,
or names a checkpoint whose metadata is empty or corrupt, falls back with a warning to the complete checkpoint
written last before it.

Checkpoints are trusted input: the RNG state loads with ``weights_only=True``, but the driver's pending rollouts
(``pending_rollouts.pt``) are pickled Python objects, so load only checkpoints you or your job wrote.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.model_checkpoint import META_FILE, _barrier, _rank, apply_model_state, load_distributed
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "TRACKER",
    "complete_checkpoints",
    "find_latest_checkpoint",
    "load_training_checkpoint",
    "save_training_checkpoint",
]

log = get_logger("checkpoint")

_ITER = re.compile(r"^iter_(\d{7})$")
TRACKER = "latest_checkpointed_iteration.txt"


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


def checkpoint_dir(save: str | os.PathLike, step: int) -> Path:
    return Path(save) / f"iter_{step:07d}"


def _read_meta(ckpt: Path) -> dict[str, Any] | None:
    """A checkpoint's metadata, or None when the file is missing, empty or not a JSON object."""
    try:
        meta = json.loads((ckpt / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _written_at(ckpt: Path, meta: dict[str, Any]) -> float:
    """When a checkpoint was completed: its recorded time, else (older checkpoints) its metadata file's mtime."""
    written = meta.get("written_at")
    return float(written) if isinstance(written, (int, float)) else (ckpt / META_FILE).stat().st_mtime


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root`` (readable metadata), oldest written first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if _ITER.match(p.name) and (meta := _read_meta(p)) is not None:
            found.append((_written_at(p, meta), int(p.name.removeprefix("iter_")), p))
    return [p for *_, p in sorted(found)]


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint written last under ``root``: the one the tracker file names, or None if there is none.

    Temporary folders of interrupted writes and folders without metadata are ignored. When the tracker is missing
    or names a checkpoint whose metadata is empty or corrupt, the complete checkpoint written last is taken, with
    a warning.
    """
    root = Path(root)
    done = complete_checkpoints(root)
    tracker = root / TRACKER
    try:
        named = checkpoint_dir(root, int(tracker.read_text().strip()))
    except (OSError, ValueError):
        named = None
    if named is not None and named in done:
        return named
    if done and (named is not None or tracker.exists()):
        log.warning(
            "%s names %s, which is not a complete checkpoint (empty or corrupt %s?): resuming from %s, the complete "
            "checkpoint written last",
            tracker,
            named.name if named is not None else "no step",
            META_FILE,
            done[-1],
        )
    return done[-1] if done else None


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_training_checkpoint(
    save: str | os.PathLike,
    step: int,
    models: Sequence[MegatronModule],
    optimizer: Any,
    metadata: dict[str, Any],
    *,
    keep_last: int = 2,
    extra_models: Mapping[str, Sequence[MegatronModule]] | None = None,
    driver_objects: dict[str, Any] | None = None,
) -> Path:
    """Write ``save/iter_<step>`` atomically (collective: every rank calls it).

    Args:
        save: Checkpoint root.
        step: The training step just completed.
        models: This rank's (DDP-wrapped) chunks.
        optimizer: The Megatron optimizer (its state is sharded like the model).
        metadata: JSON-able run state (step, data position, LR schedule, config); written last by rank 0.
        keep_last: Complete checkpoints to keep (older ones are deleted after this one is in place).
        extra_models: Other models to keep with it (name -> chunks, e.g. the reference policy), each a sharded
            checkpoint in a subfolder of that name.
        driver_objects: Rank 0's own state (name -> object, e.g. rollouts generated ahead), ``<name>.pt``.
    """
    final = checkpoint_dir(save, step)
    tmp = None
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(".iter_*.tmp-*"):  # interrupted writes of earlier runs
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    box = [tmp]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    assert tmp is not None, "rank 0 makes the folder and broadcasts its path"
    with cuda_to_cpu():
        dist_checkpointing.save(_sharded(models, optimizer, is_loading=False), tmp)
        for name, chunks in (extra_models or {}).items():
            sub = os.path.join(tmp, name)
            if _rank() == 0:
                os.makedirs(sub, exist_ok=True)
            _barrier()
            dist_checkpointing.save(_sharded(chunks, None, is_loading=False), sub)
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
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        meta = {**metadata, "step": step, "world_size": world, "written_at": time.time()}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        _write_durably(final.parent / TRACKER, f"{step}\n")
        # Oldest written first, the one just written last whatever the clock says.
        complete = [p for p in complete_checkpoints(final.parent) if p != final] + [final]
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _load_models(ckpt: Path, models: Sequence[MegatronModule], optimizer: Any = None) -> dict[str, Any]:
    """Load the chunks' state (and return the loaded state dict, the optimizer's still to apply)."""
    sharded = _sharded(models, optimizer, is_loading=True)
    try:
        state = load_distributed(sharded, ckpt)
    except Exception as exc:  # noqa: BLE001 - Megatron raises several types here
        raise ValueError(f"--load: {ckpt} does not fit this model: {type(exc).__name__}: {exc}") from None
    apply_model_state(models, state, f"--load: {ckpt}")
    return state


def load_training_checkpoint(
    ckpt: str | os.PathLike,
    models: Sequence[MegatronModule],
    optimizer: Any,
    *,
    extra_models: Mapping[str, Sequence[MegatronModule]] | None = None,
) -> dict:
    """Load model and optimizer state (resharded to this run's layout) and this rank's RNG state.

    Args:
        ckpt: A complete checkpoint folder.
        models: This rank's (DDP-wrapped) chunks.
        optimizer: The Megatron optimizer.
        extra_models: Models saved beside them (name -> chunks), loaded from their subfolders.

    Returns:
        The checkpoint's metadata.

    Raises:
        ValueError: when the folder is not a complete checkpoint or does not fit the model.
    """
    ckpt = Path(ckpt)
    meta_path = ckpt / META_FILE
    if not meta_path.is_file():
        raise ValueError(
            f"--load: {ckpt} is not a complete checkpoint (no {META_FILE}); it may be an interrupted "
            "write: point --load at the checkpoint root to take the newest complete one"
        )
    metadata = _read_meta(ckpt)
    if metadata is None:
        raise ValueError(
            f"--load: {meta_path} is empty or corrupt; point --load at the checkpoint root to resume from the "
            "complete checkpoint written last"
        )
    state = _load_models(ckpt, models, optimizer)
    if optimizer is not None:
        with cuda_to_cpu():
            optimizer.load_state_dict(state["optimizer"])
    for name, chunks in (extra_models or {}).items():
        _load_models(ckpt / name, chunks)
    rng_file = ckpt / f"rng_rank{_rank():05d}.pt"
    if rng_file.is_file() and metadata.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1):
        rng = torch.load(rng_file, weights_only=True)  # tensors, ints and tuples: no pickled code runs
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    log.info("resumed from %s (step %s)", ckpt, metadata.get("step"))
    return metadata
