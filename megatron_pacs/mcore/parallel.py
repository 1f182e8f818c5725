"""Parallel state: the one place that initialises Megatron's process groups and reads its globals.

Everything else in the project receives a :class:`ParallelGroups` (or a single process group) as an argument. The
layout itself is :class:`megatron_pacs.config.ParallelConfig`.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.cpu_support import apply_cpu_support

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["ParallelGroups", "destroy_parallel", "init_parallel", "lost_rank"]


@dataclass
class ParallelGroups:
    """The process groups and ranks of this process, handed to model, log-prob and weight code."""

    config: ParallelConfig
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp_size: int
    pg_collection: ProcessGroupCollection = field(repr=False)
    """Megatron's ``ProcessGroupCollection`` for model constructors that accept one."""
    mp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """The model-parallel group (TP x PP ranks holding one copy of the model)."""
    dp_leaders: tuple[int, ...] = ()
    """For each data-parallel rank, the global rank of its model-parallel group's first member (receives that
    rank's rollouts and passes them on)."""
    rank_addresses: tuple[str, ...] = ()
    """Every global rank's network address (names the rank behind a failed collective: :func:`lost_rank`)."""
    ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """The expert-parallel group (ranks holding different experts of one MoE layer)."""
    expert_dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """The ranks holding the same experts (their gradients are averaged over it)."""
    ep_rank: int = 0
    """This rank's place in ``ep_group``: it holds experts ``[ep_rank * E / EP, (ep_rank + 1) * E / EP)``."""

    @property
    def ep_size(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def tp_size(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline (the source of broadcasts)."""
        return dist.get_process_group_ranks(self.pp_group)[-1]


def _init_process_group(backend: str | None, timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # torchrun (or ensure_world) set the rendezvous
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # A plain single process: a private store, and no RANK/WORLD_SIZE written into os.environ, where child
    # processes (a later torchrun or ensure_world launch) would inherit them and believe they are rank 0 of 1.
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage] - public API, re-exported without `as`
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def init_parallel(
    config: ParallelConfig, *, seed: int = 1234, backend: str | None = None, timeout_minutes: int | None = None
) -> ParallelGroups:
    """Initialise torch.distributed (if needed) and Megatron's TP / PP / DP (and expert) groups.

    Under ``torchrun`` the rendezvous comes from the environment; a plain single process gets a world of one.
    Uses NCCL on GPU and gloo on CPU (where the CPU support layer is installed first).

    Args:
        config: The layout.
        seed: Base seed for Megatron's model-parallel RNG streams.
        backend: Override the process-group backend.
        timeout_minutes: Collective timeout; default ``config.distributed_timeout_minutes``
            (``--distributed-timeout-minutes``).

    Returns:
        The groups and ranks of this process.
    """
    apply_cpu_support()
    if timeout_minutes is None:
        timeout_minutes = config.distributed_timeout_minutes
    _init_process_group(backend, timeout_minutes)
    world = dist.get_world_size()
    dp_size = config.data_parallel_size(world)

    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=1,  # experts whole on every TP rank (mcore/moe_weights.py)
        distributed_timeout_minutes=timeout_minutes,
    )
    model_parallel_cuda_manual_seed(seed)
    groups = ParallelGroups(
        config=config,
        # Megatron types its group globals loosely (ProcessGroup | int | list | None); initialised, they are groups.
        tp_group=cast(dist.ProcessGroup, ps.get_tensor_model_parallel_group()),
        pp_group=cast(dist.ProcessGroup, ps.get_pipeline_model_parallel_group()),
        dp_group=cast(dist.ProcessGroup, ps.get_data_parallel_group()),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=dp_size,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        mp_group=cast(dist.ProcessGroup, ps.get_model_parallel_group()),
        ep_group=cast(dist.ProcessGroup, ps.get_expert_model_parallel_group()),
        expert_dp_group=cast(dist.ProcessGroup, ps.get_expert_data_parallel_group()),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )
    groups.dp_leaders = _dp_leaders(groups)
    groups.rank_addresses = _rank_addresses()
    return groups


def _dp_leaders(groups: ParallelGroups) -> tuple[int, ...]:
    """Every DP rank's model-parallel leader, gathered once (every rank knows only its own group's ranks)."""
    assert groups.mp_group is not None
    mine = torch.tensor([groups.dp_rank, min(dist.get_process_group_ranks(groups.mp_group))], dtype=torch.long)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    leaders = {int(t[0]): int(t[1]) for t in every}
    return tuple(leaders[r] for r in range(groups.dp_size))


def _rank_addresses() -> tuple[str, ...]:
    """Every rank's network address (its route's source address towards ``MASTER_ADDR``), gathered once so that a
    failed collective's peer address can be named as a rank (:func:`lost_rank`)."""
    from megatron_pacs.utils.launch import source_address

    try:
        mine = source_address([socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1"))])
    except OSError:
        mine = "127.0.0.1"
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return tuple(str(a) for a in every)


def lost_rank(groups: ParallelGroups, error: BaseException) -> int | None:
    """The rank a failed collective's error points at: a peer whose address (gloo and c10d name the peer's
    ``[ip]:port``) appears in the message; None when the error names no other host."""
    text = str(error)
    me = dist.get_rank() if dist.is_initialized() else None
    mine = groups.rank_addresses[me] if me is not None and me < len(groups.rank_addresses) else None
    for rank, address in enumerate(groups.rank_addresses):
        if rank != me and address != mine and re.search(rf"(?<![\d.]){re.escape(address)}(?![\d.])", text):
            return rank
    return None


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
