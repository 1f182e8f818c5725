"""Run a tool on several local ranks: re-launch the current script as N processes when not under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["ensure_world", "free_port"]


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def source_address(destinations: list[str]) -> str:
    """The address this host sends from towards ``destinations`` (the kernel's route; no packet is sent): where
    peers on those hosts can reach this one. Prefers a non-loopback answer, since peers on this host reach that too.
    """
    found = []
    for dest in dict.fromkeys(destinations):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))  # UDP connect only picks the route
            found.append(s.getsockname()[0])
    outside = [a for a in found if not a.startswith("127.")]
    return (outside or found or ["127.0.0.1"])[0]


def ensure_world(world_size: int, argv: list[str] | None = None) -> int | None:
    """Start ``world_size`` local ranks of this script when needed.

    If ``world_size > 1`` and the process was not started by torchrun (no ``RANK`` in the environment), runs
    ``python <script> <args>`` ``world_size`` times with the rendezvous variables torchrun would set, waits, and
    returns the first non-zero exit code (0 if all succeed); the caller then exits with it. Otherwise returns None
    and the caller carries on in this process. ``python`` is ``$PYTHON_EXEC`` where set, as for torchrun's workers,
    else this interpreter. (torchrun's own CLI is not used: its option parser claims abbreviations such as
    ``--num`` even after the script name.)
    """
    if world_size <= 1 or "RANK" in os.environ:
        return None
    args = sys.argv[1:] if argv is None else argv
    base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    procs = [
        subprocess.Popen([python, sys.argv[0], *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(world_size)
    ]
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):  # one rank failed: the others would hang
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return next((p.returncode for p in procs if p.returncode != 0), 0)
