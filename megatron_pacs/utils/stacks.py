"""Hang diagnosis: every thread's Python stack written to ``<log-dir>/stacks/rank<R>-<time>.txt``.

:meth:`StackDumps.dump` writes one file now (the heartbeat does before it ends a process on a lost rank).
:meth:`StackDumps.arm_late_dump` writes one if it is not called again in time (the heartbeat re-arms it after each
exchange with the store, so a rank whose beats stall leaves the stacks of that moment, and the run goes on).
:meth:`StackDumps.install` makes SIGUSR1 do the same at any time without stopping the run::

    pkill -USR1 -f 'python[0-9.]* -u -m megatron_pacs.train'     # every rank on this host (not the launcher)
    kill -USR1 <pid of one rank>

A Python signal handler would only run when the main thread next executes bytecode, which it does not while it
waits in a collective (C++). :mod:`faulthandler`'s handler is C: it writes the stacks from inside the signal
handler, whatever the main thread is doing, into a pipe; a reader thread (blocked in ``os.read``, which releases
the GIL) copies each dump into its own file. A launcher must not be sent the signal: SIGUSR1 ends a process that
does not handle it, torch elastic's agent included.
"""

from __future__ import annotations

import faulthandler
import fcntl
import logging
import os
import signal
import threading
import time
from pathlib import Path

from megatron_pacs.utils.logging import get_logger

__all__ = ["StackDumps"]

log = get_logger("stacks")

_PIPE_BYTES = 1 << 20
"""The pipe's capacity. faulthandler writes at most 100 threads x 100 frames; the signal can land on a thread that
holds the GIL, and the reader thread needs the GIL to drain the pipe: a dump larger than the pipe would block the
handler's write forever (a deadlock), so the pipe holds a whole dump."""

_QUIET_S = 0.3
"""A dump is complete once the pipe has been quiet this long (faulthandler writes it in one burst)."""


class StackDumps:
    """Writes every thread's stack of this process to ``folder`` (see the module docstring).

    Args:
        folder: Where the files go (created on the first dump).
        rank: This process's rank, in each file's name.
    """

    def __init__(self, folder: Path | str, rank: int) -> None:
        self.folder, self.rank = Path(folder), rank
        self._lock = threading.Lock()
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._signum: int | None = None
        self._reader: threading.Thread | None = None
        self._late_write_fd: int | None = None  # the watchdog's pipe (arm_late_dump)
        self._late_reader: threading.Thread | None = None

    def _path(self) -> Path:
        """A new file: ``rank<R>-<YYYYmmddTHHMMSS>.txt`` (``-2``, ``-3``... for more dumps in the same second)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}-{time.strftime('%Y%m%dT%H%M%S')}"
        path, n = self.folder / f"{stem}.txt", 1
        while path.exists():
            n += 1
            path = self.folder / f"{stem}-{n}.txt"
        return path

    def _header(self, reason: str) -> str:
        names = "".join(f"  0x{t.ident:016x} {t.name}\n" for t in threading.enumerate() if t.ident is not None)
        return f"rank {self.rank}, pid {os.getpid()}: {reason}\nthreads:\n{names}\n"

    def dump(self, reason: str) -> Path | None:
        """Write every thread's stack to a new file now; returns it (None when it could not be written: logged).

        Args:
            reason: The file's first line (why the stacks were taken).
        """
        with self._lock:
            try:
                path = self._path()
                with open(path, "w") as f:
                    f.write(self._header(reason))
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                return path
            except OSError as exc:
                log.warning("stacks: could not write a dump under %s: %s", self.folder, exc)
                return None

    def install(self, signum: int = signal.SIGUSR1) -> None:
        """Dump on ``signum`` from now on (see the module docstring); :meth:`close` undoes it."""
        if self._signum is not None:
            return
        self._read_fd, self._write_fd = _pipe()
        faulthandler.register(signum, file=self._write_fd, all_threads=True, chain=False)
        self._signum = signum
        name = signal.Signals(signum).name
        self._reader = threading.Thread(
            target=self._read,
            args=(self._read_fd, f"{name} (asked for; the run goes on)", logging.INFO),
            name="stack-dumps",
        )
        self._reader.daemon = True
        self._reader.start()

    def arm_late_dump(self, seconds: float, reason: str) -> None:
        """Write every thread's stack ``seconds`` from now unless this is called again first (or
        :meth:`disarm_late_dump`). :mod:`faulthandler`'s watchdog thread writes it without the GIL, so a thread that
        holds the GIL through a long C call is caught in it; the run goes on. One watchdog per process: this replaces
        any other :func:`faulthandler.dump_traceback_later`.

        Args:
            seconds: How long to wait for the next call.
            reason: The file's first line (fixed by the first call).
        """
        if self._late_write_fd is None:
            read_fd, self._late_write_fd = _pipe()
            self._late_reader = threading.Thread(
                target=self._read, args=(read_fd, reason, logging.WARNING), name="late-stack-dumps"
            )
            self._late_reader.daemon = True
            self._late_reader.start()
        faulthandler.dump_traceback_later(seconds, repeat=False, file=self._late_write_fd, exit=False)

    def disarm_late_dump(self) -> None:
        """Cancel the dump :meth:`arm_late_dump` armed, if any."""
        if self._late_write_fd is not None:
            faulthandler.cancel_dump_traceback_later()

    def _read(self, fd: int, reason: str, level: int) -> None:
        """Copy each burst the handler writes into the pipe into its own file, until the write end closes."""
        import select

        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            parts = [chunk]
            while select.select([fd], [], [], _QUIET_S)[0]:
                more = os.read(fd, 65536)
                if not more:
                    break
                parts.append(more)
            with self._lock:
                try:
                    path = self._path()
                    path.write_bytes(self._header(reason).encode() + b"".join(parts))
                    log.log(level, "stacks: %s: every thread's stack written to %s", reason, path)
                except OSError as exc:
                    log.warning("stacks: could not write a dump under %s: %s", self.folder, exc)
        os.close(fd)

    def close(self) -> None:
        """Restore the signal's previous handling, cancel a late dump, and stop the reader threads (bounded)."""
        if self._late_write_fd is not None:
            faulthandler.cancel_dump_traceback_later()
            os.close(self._late_write_fd)  # its reader returns
            self._late_write_fd = None
        if self._late_reader is not None:
            self._late_reader.join(timeout=5.0)
            self._late_reader = None
        if self._signum is None:
            return
        faulthandler.unregister(self._signum)
        self._signum = None
        if self._write_fd is not None:
            os.close(self._write_fd)  # the reader sees the end of the pipe, closes its end and returns
            self._write_fd = None
        if self._reader is not None:
            self._reader.join(timeout=5.0)
            self._reader = None


def _pipe() -> tuple[int, int]:
    """A pipe that holds a whole dump (:data:`_PIPE_BYTES`); returns (read end, write end)."""
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size: keep the default (64 KiB, enough for most processes)
        pass
    return read_fd, write_fd
