"""Where the fleet's work goes, as plain functions (no Ray import): chunks of prompts onto engines, the GPUs a
locally started Ray may hand to engines, and Ray's temp folder."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["balance_chunks", "local_engine_gpus", "short_temp_dir", "visible_devices"]


def balance_chunks(costs: Sequence[float], num_chunks: int) -> list[list[int]]:
    """Split item indices into at most ``num_chunks`` chunks of similar total cost (longest first onto the lightest
    chunk); each chunk lists its indices in increasing order."""
    num_chunks = max(1, min(len(costs), num_chunks))
    chunks: list[list[int]] = [[] for _ in range(num_chunks)]
    loads = [0.0] * num_chunks
    for i in sorted(range(len(costs)), key=lambda j: -costs[j]):
        k = loads.index(min(loads))
        chunks[k].append(i)
        loads[k] += costs[i]
    return [sorted(c) for c in chunks if c]


def local_engine_gpus(
    *,
    visible: str | None,
    device_count: int,
    local_trainer_ranks: int,
    colocate: bool,
    current_device: int,
    needed: int,
    share: bool = False,
) -> list[str]:
    """The GPUs (as ``CUDA_VISIBLE_DEVICES`` entries) a Ray started by trainer rank 0 may give to engines.

    Local rank ``r`` trains on device ``r`` (``torch.cuda.set_device(LOCAL_RANK)``). Engines beside the trainer get
    the devices after the trainer's; colocated engines get exactly rank 0's device (the one its CUDA IPC handles
    name), so an engine never lands on a GPU another rank is training on. With ``share``, one engine of one GPU and
    no GPU left after the trainer's (a one-GPU machine) shares rank 0's device, both resident.

    Args:
        visible: This process's ``CUDA_VISIBLE_DEVICES`` (None: all devices, numbered 0..device_count-1).
        device_count: ``torch.cuda.device_count()``.
        local_trainer_ranks: Trainer ranks on this node (``LOCAL_WORLD_SIZE``).
        colocate: ``--colocate``.
        current_device: Rank 0's device index.
        needed: GPUs the fleet needs (``--num-engines`` x ``--rollout-tensor-parallel-size``).
        share: ``--gpu-memory-utilization`` is set: the engine's share of a GPU it would share with rank 0.

    Raises:
        ValueError: Too few GPUs are left, naming the flags that fix it.
    """
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(device_count)]
    names = names[:device_count]
    if colocate:
        free = names[current_device : current_device + 1]
    else:
        free = names[local_trainer_ranks:]
        if not free and needed == 1 and share:
            free = names[current_device : current_device + 1]
    if len(free) < needed:
        where = "rank 0's GPU" if colocate else f"this node's GPUs left after its {local_trainer_ranks} trainer rank(s)"
        raise ValueError(
            f"--num-engines x --rollout-tensor-parallel-size needs {needed} GPU(s), but the local Ray may only use "
            f"{where}: {len(free)} of {len(names)} visible. Start fewer trainer ranks (torchrun --nproc-per-node), "
            "fewer or smaller engines, --colocate, --gpu-memory-utilization (one engine of one GPU then shares rank "
            "0's, its share of memory given), or point --ray-address at a rollout cluster"
        )
    return free


def short_temp_dir(run_dir: str) -> str:
    """Ray's temp folder (removed at shutdown): inside the run dir unless its socket paths would pass the 107-byte
    Unix limit, then a short one under the system temp folder."""
    wanted = os.path.abspath(os.path.join(run_dir, "ray"))
    if len(wanted) + len("/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store") < 107:
        os.makedirs(wanted, exist_ok=True)
        return wanted
    return tempfile.mkdtemp(prefix="mpacs_ray_")


@contextmanager
def visible_devices(names: Sequence[str] | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set to ``names`` inside the block (processes started there see only those GPUs),
    restored after; None leaves it alone. A CUDA context this process already holds is not affected."""
    if names is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
