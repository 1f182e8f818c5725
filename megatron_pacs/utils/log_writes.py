"""A failed write into ``--log-dir``: one line naming the path, the step and the OS error.

A write into ``--log-dir`` that fails (a full disk) raises :class:`LogWriteError`: one line naming the path, the
step and the OS error (e.g. ``ENOSPC``); the trainer adds what it kept of the step (docs/training.md, "Outputs").
The checks of a run's output folders before anything starts are :mod:`megatron_pacs.outputs`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LogWriteError", "any_rank", "log_write", "os_error_text"]


def os_error_text(exc: OSError) -> str:
    """``ENOSPC (No space left on device)``: the error's symbolic name and its text."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    text = exc.strerror or str(exc)
    return f"{name} ({text})" if name else text


class LogWriteError(RuntimeError):
    """A write into ``--log-dir`` failed. ``str()`` is the one line the run stops with.

    Attributes:
        path: The file or folder being written.
        step: The training step it belonged to (None outside a step, e.g. at the end of the run).
        error: The OS error.
        outcome: What the run kept of the step (set by the trainer; "" until then).
    """

    def __init__(self, path: str | os.PathLike, step: int | None, error: OSError) -> None:
        super().__init__(str(path))
        self.path, self.step, self.error = Path(path), step, error
        self.outcome = ""

    def __str__(self) -> str:
        when = f"at step {self.step}" if self.step is not None else "at the end of the run"
        line = f"--log-dir: writing {self.path} {when} failed: {os_error_text(self.error)}"
        return f"{line}; {self.outcome}" if self.outcome else line


@contextmanager
def log_write(path: str | os.PathLike, step: int | None) -> Iterator[None]:
    """Turn an ``OSError`` of the writes inside the block into a :class:`LogWriteError` naming ``path`` and ``step``.

    Args:
        path: What the block writes (a file, or the folder of a sink such as ``tensorboard/``).
        step: The step being written (None outside a step).
    """
    try:
        yield
    except LogWriteError:
        raise
    except OSError as exc:
        raise LogWriteError(path, step, exc) from exc


def any_rank(failed: bool) -> bool:
    """Collective where a process group exists: whether any rank's ``failed`` is True (every rank gets the same
    answer); ``failed`` itself without one, or with one rank."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
