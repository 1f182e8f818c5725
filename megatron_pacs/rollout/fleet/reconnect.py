"""Connecting again to a rollout cluster whose head was lost (``--rollout-cluster-reconnect-seconds``).

Through Ray Client (``ray://host:10001``) a lost head shows as a broken connection: Ray Client first tries to reach
the same server again for its grace period (``RAY_CLIENT_RECONNECT_GRACE_PERIOD``, 30 s; a network blip keeps the
session and its actors), then the call in flight raises ``ConnectionError`` and every later call "Ray Client is not
connected". A head started again is a new cluster: nothing of the old session (actors, objects) is in it. So the
fleet (:meth:`~megatron_pacs.rollout.fleet.EngineSet._reconnect`) waits for the head's client port here, connects
again, starts its engines anew and re-syncs them from its host copy of the last update.
"""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlsplit

import ray

from megatron_pacs.rollout.fleet.ray_start import client_init
from megatron_pacs.utils.logging import get_logger

__all__ = ["DEFAULT_CLIENT_PORT", "client_endpoint", "connect_again", "connection_lost"]

log = get_logger("rollout.fleet")

DEFAULT_CLIENT_PORT = 10001
"""Ray Client's port when ``ray://host`` names none."""

_NOT_CONNECTED = "Ray Client is not connected"


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is Ray Client's broken connection to the head."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionError) or _NOT_CONNECTED in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def client_endpoint(address: str) -> tuple[str, int]:
    """``ray://host:port`` -> ``(host, port)`` (port 10001 when none is given)."""
    parts = urlsplit(address)
    return parts.hostname or "", parts.port or DEFAULT_CLIENT_PORT


def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def connect_again(
    address: str, deadline: float, *, runtime_env: dict[str, Any] | None = None, poll_s: float = 1.0
) -> bool:
    """Wait (until ``deadline``, ``time.monotonic()``) for the head's client port to accept connections, then
    ``ray.init`` again (with ``runtime_env``, ``--ray-runtime-env``); a head whose client server is not ready yet is
    tried again until the deadline.

    Returns:
        Whether this process is connected again.
    """
    try:
        ray.shutdown()  # the broken client: ray.init refuses to run twice
    except Exception as exc:  # noqa: BLE001 - what is left of a broken connection
        log.warning("fleet: ray.shutdown() after the lost connection: %s", exc)
    host, port = client_endpoint(address)
    while time.monotonic() < deadline:
        if not _port_open(host, port, timeout=min(poll_s, max(0.1, deadline - time.monotonic()))):
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            continue
        try:
            client_init(address, runtime_env)
            return True
        except Exception as exc:  # noqa: BLE001 - the head is still starting: its client server refused us
            log.warning("fleet: connecting to %s again failed (%s); retrying until the window ends", address, exc)
            try:
                ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    return False
