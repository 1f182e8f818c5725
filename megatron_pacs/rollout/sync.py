"""Weight sync plumbing shared by the trainer and the engines: buckets, flat packing, and a side process group.

The trainer streams ``(hf_name, tensor)`` pairs. They are grouped into buckets of about ``bucket_bytes`` and each
bucket is packed into one flat ``uint8`` buffer plus a list of :class:`TensorMeta`, so that a transport moves one
contiguous buffer per bucket whatever it is:

- ``object_store`` (CPU, or GPU clusters without a shared fabric): the packed bucket goes through Ray's object
  store; the engine unpacks views of it.
- ``broadcast`` (disaggregated GPUs): trainer rank 0 and every engine worker join a side process group
  (:func:`standalone_group`, NCCL on GPU) and the buffer is broadcast from the trainer. The same code runs with
  gloo on CPU, which is how it is tested here.
- ``ipc`` (colocated GPUs): the trainer hands the engine a CUDA IPC handle of the packed buffer
  (:func:`ipc_handle`, plain values that vLLM's msgpack RPC carries) and the engine maps it (:func:`rebuild_ipc`);
  the mapping needs CUDA, so only the handle's round trip is checked here.

Everything here is plain PyTorch: no vLLM or Ray import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = [
    "SideGroup",
    "TensorMeta",
    "add_tied_lm_head",
    "broadcast_buffer",
    "close_group",
    "ipc_handle",
    "iter_buckets",
    "pack_bucket",
    "rebuild_ipc",
    "standalone_group",
    "unpack_bucket",
]

_ALIGN = 16  # byte alignment of every tensor inside a packed buffer (safe for any dtype view)


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a packed bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of about ``bucket_bytes`` (a larger tensor is its own bucket).

    The stream is consumed lazily, so at most one bucket of the trainer's gathered weights exists at a time.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive (the weight-sync bucket size)")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], device: torch.device | str | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Copy a bucket into one flat byte buffer.

    Args:
        bucket: ``(name, tensor)`` pairs of any dtypes and shapes.
        device: Where to allocate the buffer (default: the first tensor's device).

    Returns:
        ``(buffer [B] uint8, metas)``.
    """
    if not bucket:
        raise ValueError("pack_bucket needs at least one tensor")
    metas, offset = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, nbytes))
        offset = _aligned(offset + nbytes)
    buffer = torch.empty(offset, dtype=torch.uint8, device=device or bucket[0][1].device)
    for (_, t), m in zip(bucket, metas, strict=True):
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[m.offset : m.offset + m.nbytes].copy_(src)
    return buffer, metas


def unpack_bucket(buffer: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors inside a packed buffer (no copy): the inverse of :func:`pack_bucket`."""
    out = []
    for m in metas:
        dtype = getattr(torch, m.dtype)
        out.append((m.name, buffer[m.offset : m.offset + m.nbytes].view(dtype).view(m.shape)))
    return out


def add_tied_lm_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stream, plus ``lm_head.weight`` after ``model.embed_tokens.weight`` for tied-embedding models.

    Exporters omit the tied output layer, but vLLM keeps its own ``lm_head`` that a reload must also refresh:
    without it the engine silently keeps sampling from the old output layer.
    """
    seen_head = False
    for name, t in named_tensors:
        seen_head |= name == "lm_head.weight"
        yield name, t
        if tied and name == "model.embed_tokens.weight" and not seen_head:
            seen_head = True
            yield "lm_head.weight", t


@dataclass
class SideGroup:
    """A process group outside the default one, with the TCP store it was built on (kept alive with it)."""

    group: Any
    """The c10d backend itself (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), used without a ``ProcessGroup``;
    typed ``Any`` because torch's stubs omit the collectives (``broadcast``) that a backend has at runtime."""
    store: Store
    rank: int
    world_size: int


def standalone_group(
    backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0
) -> SideGroup:
    """A process group outside the default one, built from its own TCP store.

    The trainer's rank 0 (rank 0 here, the store's host) and every engine worker (ranks 1..) join it to
    broadcast weight buckets, without touching either side's default process group.

    Args:
        backend: ``"nccl"`` on GPU, ``"gloo"`` on CPU.
        host, port: The TCP store's address; rank 0 listens there.
        rank, world_size: This member's rank and the group's size.
        timeout_s: Store and collective timeout.
    """
    timeout = timedelta(seconds=timeout_s)
    # TCPStore is documented as torch.distributed's, but torch does not re-export it for type checkers.
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]
    from torch.distributed.distributed_c10d import PrefixStore

    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = PrefixStore("megatron_pacs_weight_sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ValueError("weight sync transport 'broadcast' with NCCL needs a CUDA build of torch")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"backend={backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
    return SideGroup(group, store, rank, world_size)


def broadcast_buffer(side: SideGroup, buffer: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
    """Broadcast ``buffer`` in place over a :func:`standalone_group`.

    Returns:
        With ``async_op`` the pending work (poll ``is_completed()``), else None after completion.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    work = side.group.broadcast([buffer], opts)
    if async_op:
        return work
    work.wait()
    return None


def close_group(side: SideGroup | None) -> None:
    """Release a side group whose membership changed (an engine restarted). An NCCL communicator is aborted, since
    a collective with a dead member would hang until its timeout; a gloo group is just dropped."""
    if side is None or isinstance(side.group, dist.ProcessGroupGloo):
        return
    abort = getattr(side.group, "abort", None)
    if callable(abort):
        try:
            abort()
        except Exception:  # noqa: BLE001 - a communicator that already failed has nothing left to abort
            pass


def ipc_handle(buffer: torch.Tensor) -> list[Any]:
    """A CUDA buffer's IPC handle as plain values (ints, bools, bytes), which vLLM's msgpack RPC carries; the raw
    ``reduce_tensor`` output holds a function and torch classes, which it refuses on a GPU
    (``VLLM_ALLOW_INSECURE_SERIALIZATION``).

    Args:
        buffer: ``[B]`` uint8, contiguous, on a CUDA device; it must stay alive until the receivers have copied it.

    Returns:
        ``[size, stride, offset, device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle,
        ref_counter_offset, event_handle, event_sync_required]``, the inputs of :func:`rebuild_ipc`.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"ipc_handle takes a packed [B] uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
    args: Any = reduce_tensor(buffer)[1]  # torch's order: rebuild_cuda_tensor's parameters
    _, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, counter, counter_offset = args[:13]
    event_handle, event_sync = args[13:15]
    return [
        list(size),
        list(stride),
        int(offset),
        int(device),
        bytes(handle),
        int(storage_bytes),
        int(storage_offset),
        bytes(counter),
        int(counter_offset),
        None if event_handle is None else bytes(event_handle),
        bool(event_sync),
    ]


def rebuild_ipc(handle: Sequence[Any], device: int) -> torch.Tensor:
    """Map a buffer sent as :func:`ipc_handle` on this process's ``device`` (which, for a colocated engine with its
    own ``CUDA_VISIBLE_DEVICES``, numbers the same GPU differently from the sender).

    Returns:
        ``[B]`` uint8 on ``device``, sharing the sender's memory.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size, stride, offset, _, ipc, storage_bytes, storage_offset, counter, counter_offset, event, sync = handle
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        bytes(ipc),
        storage_bytes,
        storage_offset,
        False,
        bytes(counter),
        counter_offset,
        None if event is None else bytes(event),
        sync,
    )
