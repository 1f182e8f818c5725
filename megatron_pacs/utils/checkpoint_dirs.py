"""What a checkpoint directory holds, read without torch or Megatron (validation reads it before anything is built).

Layout under ``--save``::

    iter_0000020/                      a complete checkpoint (megatron_pacs.json written last, then the folder renamed)
    .iter_0000040.tmp-XXXX/            a write in progress, or an interrupted one (never loaded)
    iter_0000030.abandoned-YYYYMMDD-HHMMSS/  a checkpoint off the resumed lineage, set aside (never loaded)
    latest_checkpointed_iteration.txt  the step written last (Megatron-LM's and verl's tracker file)
    checkpoint_lineage.json            each checkpoint's parent: the one its run resumed from or saved before it
    .megatron_pacs.lock                the run writing here (:mod:`megatron_pacs.utils.run_lock`)

A checkpoint's lineage is itself, its parent, its parent's parent, ... within the directory. A checkpoint written
before lineages were recorded has, as its parent, the complete checkpoint written before it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_pacs.utils.logging import get_logger

__all__ = [
    "LINEAGE_FILE",
    "META_FILE",
    "TRACKER",
    "CheckpointWriteError",
    "LoadChoice",
    "checkpoint_dir",
    "choose_checkpoint",
    "complete_checkpoints",
    "lineage",
    "read_metadata",
    "read_parents",
    "remove_stale_temp_folders",
    "set_aside",
]

log = get_logger("checkpoint")

META_FILE = "megatron_pacs.json"
TRACKER = "latest_checkpointed_iteration.txt"
LINEAGE_FILE = "checkpoint_lineage.json"
ITER = re.compile(r"^iter_(\d{7})$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error); the message says where and what resumes."""


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/iter_<step, 7 digits>``."""
    return Path(root) / f"iter_{step:07d}"


def read_metadata(ckpt: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``megatron_pacs.json``.

    Raises:
        ValueError: one line naming the file and what is wrong with it (missing, unreadable, empty, not JSON, not
            a JSON object).
    """
    path = Path(ckpt) / META_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: {ckpt} is not a complete checkpoint (an interrupted write?)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from None
    if not text.strip():
        raise ValueError(f"{path} is empty (a write cut short?)")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not an object")
    return meta


def _try_metadata(ckpt: Path) -> dict[str, Any] | None:
    try:
        return read_metadata(ckpt)
    except ValueError:
        return None


def _iter_folders(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if ITER.match(p.name) and p.is_dir()] if root.is_dir() else []


def _written_at(ckpt: Path, meta: dict[str, Any] | None) -> float:
    """When a checkpoint was completed: its recorded time, else its metadata file's (or folder's) mtime."""
    written = (meta or {}).get("written_at")
    if isinstance(written, (int, float)):
        return float(written)
    path = ckpt / META_FILE
    return (path if path.exists() else ckpt).stat().st_mtime


def _by_write_time(root: Path, *, complete_only: bool) -> list[Path]:
    found = []
    for p in _iter_folders(root):
        meta = _try_metadata(p)
        if meta is not None or not complete_only:
            found.append((_written_at(p, meta), int(p.name.removeprefix("iter_")), p))
    return [p for *_, p in sorted(found)]


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root`` (readable metadata), oldest written first."""
    return _by_write_time(Path(root), complete_only=True)


def read_parents(root: str | os.PathLike) -> dict[str, str | None]:
    """Each checkpoint's parent as recorded (folder name within ``root``, an outside path, or None for a fresh
    start): ``checkpoint_lineage.json``, then the ``parent`` of every readable metadata file."""
    root = Path(root)
    parents: dict[str, str | None] = {}
    try:
        recorded = json.loads((root / LINEAGE_FILE).read_text())
        if isinstance(recorded, dict):
            parents.update({str(k): v if isinstance(v, str) else None for k, v in recorded.items()})
    except (OSError, ValueError):
        pass
    for p in _iter_folders(root):
        meta = _try_metadata(p)
        if meta is not None and "parent" in meta:
            parents[p.name] = meta["parent"] if isinstance(meta["parent"], str) else None
    return parents


def lineage(root: str | os.PathLike, ckpt: str | os.PathLike) -> list[Path]:
    """``ckpt`` and its ancestors within ``root``, newest first (complete or not)."""
    root = Path(root)
    parents = read_parents(root)
    order = _by_write_time(root, complete_only=False)
    chain, name = [], Path(ckpt).name
    while name not in {p.name for p in chain}:
        chain.append(root / name)
        if name in parents:
            parent = parents[name]
            if parent is None or not ITER.match(parent) or not (root / parent).is_dir():
                break
            name = parent
        else:  # written before lineages were recorded: the complete checkpoint written before it
            here = [p.name for p in order]
            earlier = order[: here.index(name)] if name in here else []
            complete = [p for p in earlier if _try_metadata(p) is not None]
            if not complete:
                break
            name = complete[-1].name
    return chain


@dataclass
class LoadChoice:
    """What ``--load`` resumes from.

    Attributes:
        checkpoint: The checkpoint to resume, or None when the directory holds no complete one.
        notes: Warnings for the log (a damaged newest checkpoint passed over, checkpoints not chosen).
        damaged: ``"file: problem"`` for every checkpoint folder whose metadata cannot be read.
        holds_checkpoints: The directory holds ``iter_*`` folders or a tracker (something was saved there).
    """

    checkpoint: Path | None
    notes: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    holds_checkpoints: bool = False


def choose_checkpoint(load: str | os.PathLike) -> LoadChoice:
    """The checkpoint ``--load`` names: the folder itself when it is one, else the checkpoint the tracker names, or
    (when that one is damaged or gone) the newest complete checkpoint of its lineage.

    Raises:
        ValueError: naming the file, when ``load`` is a checkpoint folder with damaged metadata, or when the newest
            checkpoint is damaged and no checkpoint of its lineage is complete.
    """
    root = Path(load)
    if (root / META_FILE).exists() or (ITER.match(root.name) and root.is_dir()):
        try:
            read_metadata(root)
        except ValueError as exc:
            raise ValueError(f"{exc}; --load another checkpoint, or the checkpoint root {root.parent}") from None
        return LoadChoice(root, holds_checkpoints=True)
    folders = _iter_folders(root)
    tracker = root / TRACKER
    damaged = []
    for p in sorted(folders):
        try:
            read_metadata(p)
        except ValueError as exc:
            damaged.append(str(exc))
    done = complete_checkpoints(root)
    choice = LoadChoice(None, damaged=damaged, holds_checkpoints=bool(folders) or tracker.exists())
    if not done:
        return choice
    try:
        named = checkpoint_dir(root, int(tracker.read_text().strip()))
    except (OSError, ValueError):
        named = None
    if named is not None and named in done:
        choice.checkpoint = named
        _newer_untracked(root, named, done, choice)
        return choice
    if named is None:  # no tracker (a crash before it was first written, or copied folders): the one written last
        choice.checkpoint = done[-1]
        choice.notes.append(f"{tracker} is missing or unreadable: resuming from {done[-1]}, the one written last")
        return choice
    why = "does not exist" if not named.exists() else f"is damaged ({_problem(named)})"
    chain = lineage(root, named)
    ancestors = [p for p in chain[1:] if p in done]
    others = [p.name for p in done if p not in chain]
    if not ancestors:
        raise ValueError(
            f"{tracker} names {named.name}, which {why}, and no checkpoint of its lineage is complete"
            + (f" (off its lineage: {', '.join(others)})" if others else "")
            + f"; resume one explicitly with --load {root}/iter_NNNNNNN, or repair or remove {named}"
        )
    choice.checkpoint = ancestors[0]
    choice.notes.append(
        f"{tracker} names {named.name}, which {why}: resuming from {ancestors[0].name}, the newest complete "
        "checkpoint of its lineage" + (f" (not from {', '.join(others)}: off that lineage)" if others else "")
    )
    return choice


def _newer_untracked(root: Path, named: Path, done: list[Path], choice: LoadChoice) -> None:
    """Complete checkpoints written after the tracker's ``named`` (a save stopped between its rename and the
    tracker's write): the newest that descends from ``named`` is resumed instead; the others are named in a note."""
    newer = done[done.index(named) + 1 :]
    if not newer:
        return
    tracker = root / TRACKER
    recorded = read_parents(root)  # only a recorded lineage proves descent (older checkpoints keep the tracker's)
    descendants = [p for p in newer if p.name in recorded and named in lineage(root, p)]
    if descendants:
        choice.checkpoint = descendants[-1]
        choice.notes.append(
            f"{tracker} names {named.name}, but {descendants[-1].name}, complete and descending from it, was written "
            f"later without a tracker entry (a save stopped before its tracker write): resuming from "
            f"{descendants[-1].name}"
        )
    others = [p.name for p in newer if p not in descendants]
    if others:
        choice.notes.append(
            f"{', '.join(others)}: complete, written after {named.name} without a tracker entry and off the lineage "
            f"of {choice.checkpoint.name if choice.checkpoint else named.name} (a save of another branch stopped "
            f"before its tracker write): not resumed; --load {root}/<name> resumes one explicitly"
        )


def _problem(ckpt: Path) -> str:
    try:
        read_metadata(ckpt)
    except ValueError as exc:
        return str(exc)
    return "complete"


def remove_stale_temp_folders(root: str | os.PathLike) -> None:
    """Remove the ``.iter_*.tmp-*`` folders of interrupted writes (only while holding ``root``'s run lock: then no
    other run is writing them)."""
    for stale in sorted(Path(root).glob(".iter_*.tmp-*")):
        log.info("removing %s, an interrupted checkpoint write of an earlier run", stale)
        shutil.rmtree(stale, ignore_errors=True)


def set_aside(ckpt: Path) -> Path:
    """Rename ``ckpt`` to ``<name>.abandoned-<local time>`` (never loaded, never deleted by a save)."""
    target = ckpt.with_name(f"{ckpt.name}.abandoned-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while target.exists():
        target, n = ckpt.with_name(f"{ckpt.name}.abandoned-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
    os.replace(ckpt, target)
    return target
