"""Run a tool on several local ranks: re-launch the current script under torchrun when it is not already."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

__all__ = ["ensure_world", "free_port"]


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_world(world_size: int, argv: list[str] | None = None) -> int | None:
    """If ``world_size > 1`` and this process was not started by torchrun, re-run the script on
    ``world_size`` local ranks and return their exit code; otherwise return None (carry on in-process)."""
    if world_size <= 1 or "RANK" in os.environ:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
           f"--master-port={free_port()}", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode
