"""One run per ``--save`` directory: an exclusive lock that names its holder.

The lock is ``.megatron_pacs.lock`` in the directory: a ``flock`` held for the whole run on a file holding a JSON
record of the holder (host, pid, start time). A second run is refused with one line naming the holder. A record
whose holder is gone is taken over with a warning: on this host when no process holds the ``flock`` (the kernel
releases it when the holder dies); from another host, whose ``flock`` a shared filesystem may not show, when the
holder has not refreshed the record (its mtime, every ``heartbeat_s``) for ``stale_after_s``, or at once when the
record names a Slurm job that is this one requeued (the same ``SLURM_JOB_ID``, a higher ``SLURM_RESTART_COUNT``: the
holder is the job's earlier run, ended by the requeue) or a Slurm job that has ended (``squeue -h -j ID`` lists
nothing, or ``scontrol show job ID`` says it is no longer pending, running, suspended or completing; asked only where
those commands exist). The released lock keeps an empty file: removing it would let a run that opened it before the
removal hold a lock nobody sees.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
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
            record: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
            record.update(_slurm_job())
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
        ended = _slurm_job_ended(holder)
        if ended is not None:
            log.warning("--save %s: taking over the lock of %s at once: %s", self.directory, _who(holder), ended)
            return
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


def _slurm_job() -> dict[str, Any]:
    """This process's Slurm job id and restart count, for its record ({} outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        restarts = 0
    return {"slurm_job_id": job, "slurm_restart_count": restarts}


LIVE_STATES = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "STOPPED")


def _slurm_job_ended(holder: dict[str, Any]) -> str | None:
    """Why the holder's Slurm job is over (this job requeued, or the job ended), or None when it may still run."""
    job, restarts = holder.get("slurm_job_id"), holder.get("slurm_restart_count")
    if not isinstance(job, str) or not job:
        return None
    mine = _slurm_job()
    if mine.get("slurm_job_id") == job and isinstance(restarts, int) and mine["slurm_restart_count"] > restarts:
        return (
            f"this is its Slurm job {job} requeued (restart {mine['slurm_restart_count']}, the holder's was {restarts})"
        )
    if mine.get("slurm_job_id") == job:
        return None  # this job's own run of the same restart: the flock and the refresh decide
    return _ended_per_slurm(job)


def _ended_per_slurm(job: str) -> str | None:
    """What Slurm says of another job that ended ("squeue lists nothing", its final state), or None when it runs,
    Slurm cannot tell, or Slurm's commands are absent."""
    if shutil.which("squeue"):
        try:
            out = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and not out.stdout.strip():
            return f"its Slurm job {job} has ended (squeue lists nothing)"
        if out.returncode == 0:
            return None
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        state = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")), None)
        if out.returncode == 0 and state is not None and state not in LIVE_STATES:
            return f"its Slurm job {job} has ended (scontrol: JobState={state})"
    return None


def _who(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: empty lock record"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started', '?')}"
