"""Joining the rollout cluster (``--ray-address``) or starting a Ray of the run's own, with the retries each needs.

- Ray Client's head starts one server process per client, and that process dies at its start now and then
  (ray-project/ray#63202, a race in the proxier's fork): "Starting Ray client server failed", or "Initialization
  failure from server" when the proxier finds it already a zombie. A new connection succeeds.
- A local Ray's new node must register with its GCS within a fixed 30 s (``raylet_start_wait_time_s`` in
  ray/_private/node.py, not configurable), too short on a loaded host: its start raises "The current node timed out
  during startup" and leaves its processes running. They are ended and the node started again.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import ray

from megatron_pacs.utils.logging import get_logger

__all__ = ["ATTEMPTS", "CLIENT_SERVER_START_FAILURES", "NODE_START_TIMEOUT", "join_cluster", "start_local"]

log = get_logger("rollout.fleet")

ATTEMPTS = 3
"""Tries of each start before its error is raised."""

CLIENT_SERVER_START_FAILURES = ("Starting Ray client server failed", "Initialization failure from server")
"""What Ray Client's ``ray.init`` raises when the head's per-client server died at its start (connect again)."""

NODE_START_TIMEOUT = "The current node timed out during startup"
"""What ``ray.init`` raises when its new node did not register with the GCS within Ray's fixed 30 s."""


def join_cluster(address: str) -> None:
    """``ray.init(address)``, connecting again after a Ray Client server that died at its start.

    Args:
        address: ``--ray-address`` (``ray://host:10001``, or ``host:6379`` on a cluster node).
    """
    for attempt in range(ATTEMPTS):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
            return
        except (RuntimeError, ConnectionError) as exc:
            if attempt == ATTEMPTS - 1 or not any(m in str(exc) for m in CLIENT_SERVER_START_FAILURES):
                raise
            log.warning("fleet: %s; connecting again (attempt %d of %d)", exc, attempt + 2, ATTEMPTS)
            time.sleep(5)


def start_local(**init_kwargs: Any) -> None:
    """Start a Ray node of this process's own (``ray.init(**init_kwargs)``), again where it did not register in time.

    Args:
        init_kwargs: ``ray.init``'s keywords (no ``address``).
    """
    for attempt in range(ATTEMPTS):
        before = {p.pid for p in psutil.Process().children()}
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if attempt == ATTEMPTS - 1 or NODE_START_TIMEOUT not in str(exc):
                raise
            left = [p for p in psutil.Process().children() if p.pid not in before]
            log.warning(
                "fleet: the local Ray node did not register within Ray's fixed 30 s (a loaded host?); ending the %d "
                "processes its start left and starting it again (attempt %d of %d)",
                len(left),
                attempt + 2,
                ATTEMPTS,
            )
            _end(left)


def _end(processes: list[psutil.Process], grace_s: float = 10.0) -> None:
    """Terminate ``processes`` (this process's children) and their descendants; kill what outlives ``grace_s``."""
    family = list(processes)
    for p in processes:
        try:
            family += p.children(recursive=True)
        except psutil.Error:  # gone already
            pass
    for p in family:
        try:
            p.terminate()
            p.resume()  # a stopped process acts on the TERM only once continued
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
