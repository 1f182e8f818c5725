"""One rank of tests/utils/test_heartbeat.py's gloo jobs: ``python heartbeat_ranks.py MODE LOG_DIR TIMEOUT_S``
under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts the store, as a plain env:// launch).

Modes: ``lost``: the last rank idles (the test SIGSTOPs it) while the others wait in a collective with it;
``usr1``: rank 0 waits in a collective until rank 1 joins, once the file ``LOG_DIR/go`` exists (the test sends
SIGUSR1 to rank 0 meanwhile); both then finish cleanly, rank 0 a heartbeat timeout after rank 1; ``late``: rank 0
holds the GIL in a C call (libc's ``sleep`` through ``ctypes.PyDLL``, which keeps it) for 0.25 of its heartbeat
timeout, past its late-dump time (0.2) and short of its own store verdict (0.4); rank 1 watches with a 600 s timeout,
so that it does not take rank 0 for lost; both then finish cleanly.
"""

import ctypes
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pacs.utils.heartbeat import Heartbeat
from megatron_pacs.utils.stacks import StackDumps


def wait_in_collective() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def hold_the_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the call keeps the GIL, as a long C extension call can


def main() -> int:
    mode, log_dir, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))  # the heartbeat must fire, not this
    rank, world = dist.get_rank(), dist.get_world_size()
    stacks = StackDumps(log_dir / "stacks", rank)
    stacks.install()
    if mode == "late" and rank == 1:
        timeout_s = 600.0
    beat = Heartbeat.from_environment(timeout_s, ["127.0.0.1"] * world, stacks)
    assert beat is not None
    dist.barrier()
    print(f"ready {rank} {os.getpid()}", flush=True)
    if mode == "lost":
        if rank == world - 1:
            time.sleep(120)  # stopped by the test; never reached
            return 3
        wait_in_collective()
        return 4  # never reached: the heartbeat ends the process
    if mode == "late":
        if rank == 0:
            time.sleep(timeout_s / 10 + 0.5)  # past an exchange, so that the late dump is armed
            hold_the_gil(round(timeout_s / 4))
            time.sleep(timeout_s / 10 + 0.5)  # an exchange after the hold: no verdict, the run goes on
        dist.barrier()
        beat.close()
        stacks.close()
        dist.destroy_process_group()
        return 0
    if rank == 1:
        deadline = time.monotonic() + 60
        while not (log_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"sum {wait_in_collective()} on rank {rank}", flush=True)
    dist.barrier()
    if rank == 0:  # still watching while rank 1 leaves (its last beat says so): it is not taken for lost
        time.sleep(timeout_s)
    beat.close()
    stacks.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
