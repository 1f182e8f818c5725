"""One run per ``--save`` directory: an exclusive lock that names its holder.

The lock is ``.megatron_pacs.lock`` in the directory: a ``flock`` held for the whole run on a file holding a JSON
record of the holder (host, pid, start time). A second run is refused with one line naming the holder. A record
whose holder is gone is taken over with a warning: on this host when no process holds the ``flock`` (the kernel
releases it when the holder dies); from another host, whose ``flock`` a shared filesystem may not show, when the
holder has not refreshed the record (its mtime, every ``heartbeat_s``) for ``stale_after_s``. The released lock
keeps an empty file: removing it would let a run that opened it before the removal hold a lock nobody sees.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from megatron_pacs.utils.logging import get_logger

__all__ = ["LOCK_FILE", "RunLock"]

log = get_logger("checkpoint")

LOCK_FILE = ".megatron_pacs.lock"


class RunLock:
    """The exclusive lock on a ``--save`` directory (a context manager; acquire on global rank 0 only).

    Args:
        directory: The ``--save`` directory (created if missing).
        stale_after_s: A record from another host not refreshed for this long belongs to a run that is gone.
        heartbeat_s: How often the holder refreshes its record.
    """

    def __init__(self, directory: str | os.PathLike, *, stale_after_s: float = 300.0, heartbeat_s: float = 20.0):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            ValueError: naming the holder, when another run holds it.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(self._refusal(self._holder(), "holds it")) from None
        try:
            holder = self._holder()
            if holder:
                self._take_over(holder)
            record = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
            record["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(record["started_at"]))
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Empty the record and drop the lock (a no-op when not held)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _holder(self) -> dict[str, Any]:
        """The record in the lock file ({} when it is empty or unreadable)."""
        try:
            record = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _take_over(self, holder: dict[str, Any]) -> None:
        """Take over a record left by a run that is gone, or refuse when its holder may still run elsewhere."""
        age = time.time() - self.path.stat().st_mtime
        if holder.get("host") != socket.gethostname() and age < self.stale_after_s:
            raise ValueError(
                self._refusal(
                    holder,
                    f"refreshed it {age:.0f} s ago (another host: it counts as running until {self.stale_after_s:.0f} "
                    f"s without a refresh; remove {self.path} if that run is gone)",
                )
            )
        why = "no process holds its lock" if holder.get("host") == socket.gethostname() else f"silent for {age:.0f} s"
        log.warning("--save %s: taking over the lock of %s, which is gone (%s)", self.directory, _who(holder), why)

    def _refusal(self, holder: dict[str, Any], what: str) -> str:
        return (
            f"--save: {self.directory} is in use by another run ({_who(holder)}) which {what}; two runs on one "
            "--save would overwrite each other's checkpoints: wait for it to end, or save to another directory"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError as exc:  # a flaky shared filesystem: the next beat may succeed
                log.warning("could not refresh %s: %s", self.path, exc)


def _who(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: empty lock record"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started', '?')}"
