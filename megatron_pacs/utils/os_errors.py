"""The OS error behind a failed write, for the one-line reports of a full disk (``--save``, ``--log-dir``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["os_error_in", "os_error_of", "probe_write"]


def os_error_of(exc: BaseException, directory: Path) -> OSError | None:
    """The OS error behind a failed write into ``directory`` (:func:`os_error_in`, else a probe write there), or None
    when the failure is not one of the device."""
    return os_error_in(exc) or probe_write(directory)


def os_error_in(exc: BaseException) -> OSError | None:
    """The OS error behind a failed write: ``exc`` itself, its causes, or the per-rank failures that
    torch.distributed.checkpoint collects (Megatron's ``Worker failure: [Errno 28] ...``); None when there is none."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f for f in failures.values() if isinstance(f, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def probe_write(directory: Path) -> OSError | None:
    """The OS error a 1 MiB write into ``directory`` meets now, or None: torch's zip writer reports a full disk as
    ``RuntimeError: basic_ios::clear: iostream error`` or ``unexpected pos``, without the OS error."""
    try:
        fd, path = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    except OSError as exc:
        return exc
    try:
        data = memoryview(b"\0" * (1 << 20))
        while data:  # a nearly full disk takes part of a write; the next one meets ENOSPC
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
        os.unlink(path)
    return None
