"""Ranks (each a gloo group of one) that save training checkpoints of a two-tensor model, steps 1..N-1 whole and
step N stopped by SIGKILL at one point (tests/test_checkpoint_crash_windows.py).

Usage: ``python crash_save_rank.py ROOT N POINT...``; each POINT (one of :data:`POINTS`) is a process forked after
the imports and the writer's queue server (paid once) that saves under ``ROOT/POINT``; this one prints
``POINT: <wait status>`` for each. The weights of step ``s`` are :func:`weights_at` ``(s)``.
"""

import os
import shutil
import signal
import socket
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor

POINTS = ("writes", "background", "rename", "tracker", "pruning")


def weights_at(step: int) -> dict[str, torch.Tensor]:
    return {"weight": torch.linspace(-1.0, 1.0, 64).reshape(8, 8) * step, "bias": torch.full((8,), 0.25 * step)}


class TwoTensors(torch.nn.Module):
    def __init__(self, step: int = 0) -> None:
        super().__init__()
        w = weights_at(step)
        self.weight, self.bias = torch.nn.Parameter(w["weight"]), torch.nn.Parameter(w["bias"])

    def sharded_state_dict(self):
        return {k: ShardedTensor.from_rank_offsets(k, v.detach(), replica_id=0) for k, v in self.named_parameters()}


def _die(point: str) -> None:
    print(f"killed at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Replace the save's step at ``point`` with one that does its part, if any, and then SIGKILLs this process."""
    from megatron_pacs.mcore import training_checkpoint as tc

    if point == "writes":  # every shard on disk, the RNG state and the metadata not yet
        real = tc.dist_checkpointing

        def save_then_die(*args, **kwargs):
            real.save(*args, **kwargs)
            _die(point)

        tc.dist_checkpointing = types.SimpleNamespace(save=save_then_die)  # type: ignore[assignment]
    elif point == "rename":  # renamed into place, the lineage and the tracker not yet written
        tc._record_lineage = lambda *a: _die(point)
    elif point == "tracker":  # the lineage written, the tracker not yet
        real_write = tc._write_durably
        tc._write_durably = lambda path, text: _die(point) if path.name == tc.TRACKER else real_write(path, text)
    elif point == "pruning":  # the oldest checkpoint half removed
        real_rmtree = shutil.rmtree

        def rmtree_half(path, *args, **kwargs):
            if ".tmp-pruned" in str(path) and Path(path).is_dir():
                next(p for p in Path(path).iterdir() if p.is_file()).unlink()
                _die(point)
            real_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree_half  # type: ignore[assignment]


def main(root: str, last: int, point: str) -> None:
    from megatron_pacs.mcore.async_checkpoint import start_training_checkpoint
    from megatron_pacs.mcore.cpu_support import apply_cpu_support
    from megatron_pacs.mcore.training_checkpoint import save_training_checkpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    apply_cpu_support()
    parent = None
    for step in range(1, last + 1):
        if step == last and point == "background":  # --async-save: killed while its forked writer writes
            start_training_checkpoint(root, step, [TwoTensors(step)], None, {"step": step}, parent=parent)
            _die(point)
        if step == last:
            _arm(point)
        parent = save_training_checkpoint(root, step, [TwoTensors(step)], None, {"step": step}, parent=parent)
    print("saved every step", flush=True)


if __name__ == "__main__":
    from megatron_pacs.mcore.training_checkpoint import _start_write_results_queue

    _start_write_results_queue()  # the writer's queue server (a spawned process) started once, before the forks

    for name in sys.argv[3:]:
        pid = os.fork()
        if pid == 0:
            try:
                main(os.path.join(sys.argv[1], name), int(sys.argv[2]), name)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"{name}: {status}", flush=True)
