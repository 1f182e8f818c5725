"""Joining the rollout cluster (``--ray-address``) or starting a Ray of the run's own, with the retries each needs.

- Ray Client's head starts one server process per client, and that process dies at its start now and then
  (ray-project/ray#63202, a race in the proxier's fork; measured here: 4 of 16 connections made one after another to
  one head): "Starting Ray client server failed", or "Initialization failure from server" when the proxier finds it
  already a zombie. The head answers at once, but ``ray.init`` then waits in its own clean-up until the head ends
  the session's streams, which it holds for the client's reconnect grace period and its log stream's retries
  (30-40 s); :func:`client_init` ends them at once. A new connection succeeds.
- A local Ray's new node must register with its GCS within a fixed 30 s (``raylet_start_wait_time_s`` in
  ray/_private/node.py, not configurable), too short on a loaded host: its start raises "The current node timed out
  during startup" and leaves its processes running. They are ended and the node started again.
- ``ray.init`` replaces the driver's SIGTERM handler with its own (``sys.exit``); the one in place before is put back
  (:mod:`megatron_pacs.utils.interrupts`: the run ends with one line).
- A local Ray's temporary folder (its logs and sockets) lives outside ``--log-dir``, under the system's temporary
  folder (:func:`ray_temp_dir`), unless :data:`RAY_TEMP_IN_LOG_DIR_ENV` asks for it there.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import ray
import ray._private.utils as ray_utils
from ray.util.client import ray as ray_client

from megatron_pacs.utils.interrupts import raises_on_sigterm
from megatron_pacs.utils.logging import get_logger

__all__ = [
    "ATTEMPTS",
    "CLIENT_ATTEMPTS",
    "CLIENT_SERVER_START_FAILURES",
    "NODE_START_TIMEOUT",
    "RAY_TEMP_IN_LOG_DIR_ENV",
    "client_init",
    "join_cluster",
    "ray_temp_dir",
    "start_local",
]

log = get_logger("rollout.fleet")

ATTEMPTS = 3
"""Tries of a local Ray node's start before its error is raised."""

CLIENT_ATTEMPTS = 5
"""Tries of a Ray Client connection whose server died at its start (a failed one costs about a second; at the 25%
measured for connections made one after another, five fail together once in a thousand starts)."""

CLIENT_SERVER_START_FAILURES = ("Starting Ray client server failed", "Initialization failure from server")
"""What Ray Client's ``ray.init`` raises when the head's per-client server died at its start (connect again)."""

NODE_START_TIMEOUT = "The current node timed out during startup"
"""What ``ray.init`` raises when its new node did not register with the GCS within Ray's fixed 30 s."""

RAY_TEMP_IN_LOG_DIR_ENV = "MEGATRON_PACS_RAY_TEMP_IN_LOG_DIR"
"""Set to 1: a local Ray's temporary folder goes under ``--log-dir`` (``<log-dir>/ray``, or a short folder under the
system's temporary folder where its socket paths would pass the 107-byte Unix limit)."""

SOCKET_PATH_ROOM = len("/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store")
"""What Ray appends to its temporary folder for its longest socket path (Unix sockets: 107 bytes at most)."""


def ray_temp_dir(log_dir: str) -> str:
    """A new temporary folder for a local Ray node (removed at the fleet's shutdown): ``ray_<random>`` under the
    system's temporary folder (``$TMPDIR``, or ``/tmp`` where that one is too long for Ray's socket paths), so a
    full ``--log-dir`` does not take Ray down; under ``--log-dir`` with :data:`RAY_TEMP_IN_LOG_DIR_ENV`.

    Args:
        log_dir: The run's ``--log-dir``.
    """
    if os.environ.get(RAY_TEMP_IN_LOG_DIR_ENV, "") not in ("", "0"):
        from megatron_pacs.rollout.placement import short_temp_dir

        return short_temp_dir(log_dir)
    root = tempfile.gettempdir()
    if len(os.path.join(root, "ray_12345678")) + SOCKET_PATH_ROOM >= 107:
        root = "/tmp"
    path = tempfile.mkdtemp(prefix="ray_", dir=root)
    # also when the start-up is cut short (SIGTERM, Ctrl-C) before the fleet can shut down; after Ray's own atexit
    # shutdown, which ray.init registers later (atexit runs last-in first-out)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """Keep the SIGTERM handler through ``ray.init``, which installs its own (main thread only): it is put back
    after, and where SIGTERM raises :class:`~megatron_pacs.utils.interrupts.Terminated`, Ray's is not installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    install = ray_utils.set_sigterm_handler
    if raises_on_sigterm():  # Ray's handler is not installed at all: its SystemExit could be raised in a __del__
        ray_utils.set_sigterm_handler = lambda handler: None  # (ignored there: the run went on after SIGTERM)
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def client_init(address: str, runtime_env: dict[str, Any] | None = None) -> None:
    """``ray.init(address)``, not held up by a connection that failed at its start.

    A failed ``ray.init`` closes its connection before it raises, and that close joins the connection's stream
    threads, which end only when the head ends the streams (up to 40 s after the failure; see the module docstring).
    A watcher closes the connection's gRPC channel as soon as that close begins, so the streams end at once; the
    error is raised as before. A connection that succeeds is not touched.

    Args:
        address: ``--ray-address`` (``ray://host:10001``, or ``host:6379`` on a cluster node).
        runtime_env: ``--ray-runtime-env``, the job's ``runtime_env``; None or empty: none.
    """
    context = ray_client.get_context()  # the context this thread's ray.init connects through
    done = threading.Event()

    def end_held_streams() -> None:
        while not done.wait(0.05):
            worker = context.client_worker
            if worker is not None and worker._in_shutdown:  # Worker.close() began: ray.init failed
                channel = worker.channel
                if channel is not None:
                    channel.close()  # cancels the streams; close() closes the channel again, a no-op
                return

    watcher = threading.Thread(target=end_held_streams, name="ray-client-init-watch", daemon=True)
    watcher.start()
    try:
        with _keeping_sigterm_handler():
            ray.init(address=address, include_dashboard=False, log_to_driver=True, runtime_env=runtime_env or None)
    finally:
        done.set()
        watcher.join()


def join_cluster(address: str, runtime_env: dict[str, Any] | None = None) -> None:
    """``ray.init(address)``, connecting again after a Ray Client server that died at its start.

    Args:
        address: ``--ray-address`` (``ray://host:10001``, or ``host:6379`` on a cluster node).
        runtime_env: ``--ray-runtime-env``, the job's ``runtime_env``; None or empty: none.
    """
    for attempt in range(CLIENT_ATTEMPTS):
        try:
            client_init(address, runtime_env)
            return
        except (RuntimeError, ConnectionError) as exc:
            if attempt == CLIENT_ATTEMPTS - 1 or not any(m in str(exc) for m in CLIENT_SERVER_START_FAILURES):
                raise
            log.warning("fleet: %s; connecting again (attempt %d of %d)", exc, attempt + 2, CLIENT_ATTEMPTS)
            time.sleep(1)


def start_local(**init_kwargs: Any) -> None:
    """Start a Ray node of this process's own (``ray.init(**init_kwargs)``), again where it did not register in time.

    Args:
        init_kwargs: ``ray.init``'s keywords (no ``address``).
    """
    node: list[psutil.Process] = []
    # Registered before ray.init, so it runs after Ray's own atexit shutdown (last in, first out): whatever of the
    # node outlives it. Its agents, started by the raylet, lingered for a minute after a SIGTERM during the start-up.
    atexit.register(_end_left, node)
    for attempt in range(ATTEMPTS):
        before = {p.pid for p in psutil.Process().children()}
        try:
            with _keeping_sigterm_handler():
                try:
                    ray.init(**init_kwargs)
                finally:  # also when cut short: the node's processes so far
                    node[:] = _family([p for p in psutil.Process().children() if p.pid not in before])
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


def _family(processes: list[psutil.Process]) -> list[psutil.Process]:
    """``processes`` and their descendants."""
    family = list(processes)
    for p in processes:
        try:
            family += p.children(recursive=True)
        except psutil.Error:  # gone already
            pass
    return family


def _end_left(node: list[psutil.Process]) -> None:
    """At exit: end the local node's processes still running (a pid reused since is not one of them)."""
    left = [p for p in node if p.is_running()]
    if left:
        _end(left)


def _end(processes: list[psutil.Process], grace_s: float = 10.0) -> None:
    """Terminate ``processes`` and their descendants; kill what outlives ``grace_s``."""
    family = _family(processes)
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
