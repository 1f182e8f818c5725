"""A fingerprint of every tensor a checkpoint holds, recorded from the values handed to the writer and checked when
the checkpoint is loaded: a checkpoint whose content is not what the run saved (stale weights written, a corrupted
file) is refused naming the file, never resumed.

Each rank records, per sharded key, the elements, float64 sum and float64 sum of squares of the shards it writes (its
main replicas) in ``fingerprint_rank<r>.json`` beside the shards. Both sums add up over shards, so a load in any
layout checks them: each rank sums the main replicas it loaded, the ranks gather their sums, and every key's totals
must equal the recorded ones (to float64 rounding). Cost: one reduction pass over the state (on the GPU for GPU
tensors, no copy to the host), none of the bytes hashed. With ``--async-save`` the host tensors' pass runs in the
forked writer, on its copy-on-write image of the values it writes, off the step's path; a tensor on an accelerator
(which the fork cannot reach) is summed on the device before the fork. Trade-off: a permutation of values inside
one tensor, or a change that keeps both sums, goes unnoticed; a byte hash would see those but costs a host copy and a
CPU hash of the whole state (about 100 GB at 7B with the optimizer), which is what a save must not add.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.base import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from megatron_pacs.utils.os_errors import os_error_of

__all__ = [
    "FINGERPRINT_PREFIX",
    "CheckpointContentError",
    "FingerprintedLoad",
    "FingerprintedSave",
    "fingerprint",
    "read_fingerprints",
]

FINGERPRINT_PREFIX = "fingerprint_rank"
RTOL = 1e-9
"""Relative tolerance of a key's sums (float64 sums of the same values in other shards and orders differ by rounding
only: about 1e-16 per addition level)."""


class CheckpointContentError(ValueError):
    """A checkpoint's tensors do not match the fingerprint recorded when it was written."""


Sums = dict[str, list[float]]  # key -> [elements, sum, sum of squares]


def _pairs(sharded: Any, loaded: Any) -> Iterator[tuple[ShardedTensor, Any]]:
    """Every ShardedTensor of ``sharded`` with the value at the same place in ``loaded`` (itself when None)."""
    if isinstance(sharded, dict):
        for k, v in sharded.items():
            yield from _pairs(v, None if loaded is None else loaded[k])
    elif isinstance(sharded, (list, tuple)):
        for i, v in enumerate(sharded):
            yield from _pairs(v, None if loaded is None else loaded[i])
    elif isinstance(sharded, ShardedTensor):
        yield sharded, sharded.data if loaded is None else loaded


def _main(sharded: Any, loaded: Any = None) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of every main replica in ``sharded`` (valued from ``loaded`` when given)."""
    return [
        (sh.key, value)
        for sh, value in _pairs(sharded, loaded)
        if is_main_replica(sh.replica_id) and isinstance(value, torch.Tensor)
    ]


def fingerprint(sharded: Any, loaded: Any = None) -> Sums:
    """Per sharded key, the elements, sum and sum of squares (float64) of the main replicas in ``sharded``.

    Args:
        sharded: A sharded state dict (nested dicts/lists of ShardedTensor, factories already applied).
        loaded: The state a load returned for it (same nesting); None: the ShardedTensors' own data.

    Returns:
        key -> [elements, sum, sum of squares], over this rank's main replicas only.
    """
    return _sums(_main(sharded, loaded))


def _sums(tensors: list[tuple[str, torch.Tensor]], sums: Sums | None = None) -> Sums:
    """Add each ``(key, tensor)``'s elements, sum and sum of squares to ``sums`` (a new dict when None)."""
    sums = {} if sums is None else sums
    for key, value in tensors:
        t = value.detach()
        entry = sums.setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += t.numel()
        if t.numel():
            entry[1] += float(torch.sum(t, dtype=torch.float64))
            entry[2] += float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    return sums


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _add(total: Sums, part: Sums) -> None:
    for key, (n, s, q) in part.items():
        entry = total.setdefault(key, [0.0, 0.0, 0.0])
        entry[0], entry[1], entry[2] = entry[0] + n, entry[1] + s, entry[2] + q


def read_fingerprints(ckpt_dir: str | os.PathLike) -> tuple[Sums, list[Path]] | None:
    """The recorded sums of a sharded checkpoint folder, all ranks' added up, with the files read; None when it
    recorded none (written before fingerprints were).

    Raises:
        CheckpointContentError: naming the file, when a fingerprint file is unreadable.
    """
    files = sorted(Path(ckpt_dir).glob(f"{FINGERPRINT_PREFIX}*.json"))
    if not files:
        return None
    total: Sums = {}
    for path in files:
        try:
            part = json.loads(path.read_text())
            _add(total, {str(k): [float(x) for x in v] for k, v in part.items()})
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointContentError(
                f"{path} is unreadable ({exc}): the checkpoint's content cannot be checked"
            ) from None
    return total, files


def _mismatch(key: str, recorded: list[float], loaded: list[float]) -> str | None:
    n0, s0, q0 = recorded
    n1, s1, q1 = loaded
    if n0 != n1:
        return f"{key}: {int(n1)} elements loaded, {int(n0)} written"
    scale = math.sqrt(max(n0, 1.0) * max(q0, q1)) + 1e-30
    if abs(s0 - s1) > RTOL * scale or abs(q0 - q1) > RTOL * max(q0, q1) + 1e-30:
        return f"{key}: sum {s1!r} and sum of squares {q1!r} loaded, {s0!r} and {q0!r} written"
    return None


def _files_of(ckpt_dir: Path, keys: list[str]) -> list[str]:
    """The data files that hold ``keys`` (from the checkpoint's torch.distributed.checkpoint metadata)."""
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        storage = FileSystemReader(str(ckpt_dir)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - unreadable metadata: name the folder only
        return []
    return sorted({str(ckpt_dir / info.relative_path) for index, info in storage.items() if index.fqn in keys})


def check(ckpt_dir: str | os.PathLike, sharded: Any, loaded: Any) -> None:
    """Compare what this load returned with the checkpoint's recorded fingerprint (collective: every rank calls it).

    Raises:
        CheckpointContentError: naming the data files and the keys whose content differs.
    """
    ckpt_dir = Path(ckpt_dir)
    mine = fingerprint(sharded, loaded)
    parts: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    recorded = read_fingerprints(ckpt_dir)
    if recorded is None:
        return
    want, files = recorded
    got: Sums = {}
    for part in parts:
        _add(got, part)
    problems = [m for key in sorted(got) if key in want and (m := _mismatch(key, want[key], got[key]))]
    if problems:
        keys = [p.split(": ", 1)[0] for p in problems]
        holders = _files_of(ckpt_dir, keys) or [str(ckpt_dir)]
        raise CheckpointContentError(
            f"--load: {', '.join(holders)} does not hold what was saved (checked against {files[0].parent}/"
            f"{FINGERPRINT_PREFIX}*.json): {'; '.join(problems[:3])}"
            + (f"; and {len(problems) - 3} more tensors" if len(problems) > 3 else "")
            + "; the file is damaged: --load an earlier checkpoint"
        )


class FingerprintedSave(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save that records this rank's fingerprint of the values it is handed, where the shards
    are written: in the same process for a synchronous save, in the forked writer for an asynchronous one (a tensor
    on an accelerator summed before, on the device)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        path = Path(checkpoint_dir) / f"{FINGERPRINT_PREFIX}{_rank():05d}.json"
        tensors = _main(sharded_state_dict)
        on_device = _sums([(k, t) for k, t in tensors if t.device.type != "cpu"])
        record = partial(_record, path, on_device, [(k, t) for k, t in tensors if t.device.type == "cpu"])
        request = super().async_save(sharded_state_dict, Path(checkpoint_dir))
        if request.async_fn is None:  # nothing for this rank's writer: recorded now
            record()
            return request
        write = partial(_record_then_write, record, request.async_fn, os.getpid())
        return request._replace(async_fn=write, finalize_fns=[*request.finalize_fns, partial(_recorded, path)])


def _record(path: Path, sums: Sums, on_host: list[tuple[str, torch.Tensor]]) -> None:
    path.write_text(json.dumps(_sums(on_host, sums)))


def _record_then_write(record: Callable[[], None], write: Callable[..., Any], saver: int, *args: Any, **kw: Any) -> Any:
    """The writer's call: the fingerprint, then Megatron's shard writes. In a forked writer a failed record is left
    to :func:`_recorded` to report (an exception here would end the fork before it reports its writes, and Megatron's
    finalize would wait for them)."""
    if os.getpid() == saver:
        record()
    else:
        with contextlib.suppress(Exception):
            record()
    return write(*args, **kw)


def _recorded(path: Path) -> None:
    """A save's finalize step (after every rank's writes): this rank's fingerprint is in place.

    Raises:
        OSError: the error a write into the folder meets now (a full disk), else EIO naming the file.
    """
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise os_error_of(exc, path.parent) or OSError(errno.EIO, f"{path} was not written ({exc})") from exc


class FingerprintedLoad(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load that checks what it loaded against the recorded fingerprint (:func:`check`)."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        loaded = super().load(sharded_state_dict, checkpoint_dir)
        check(checkpoint_dir, sharded_state_dict, loaded)
        return loaded
