"""Training checkpoints written in the background (``--async-save``): Megatron-Core's asynchronous distributed
checkpointing under the commit of :mod:`megatron_pacs.mcore.training_checkpoint`.

:func:`start_training_checkpoint` does on the step's path what is cheap or must hold the step's values: the temporary
folder, the save plans, the common state, the RNG states and the driver's objects. The shards' bytes, and each rank's
fingerprint of the values it writes, are written by a process forked per save, at a lower priority
(``AsyncCallsQueue(persistent=False)``: the fork holds a copy-on-write image of the state at the step, so the next
steps' updates cannot reach the files; on the GPU Megatron first copies the tensors to the host). The checkpoint
becomes visible (the rename, the lineage, the tracker, ``--keep-last`` pruning) only in
:meth:`PendingCheckpoint.finish`, once every rank's writes are done and their results gathered: Megatron's finalize
callbacks on every rank, then the commit with its all-rank outcome. A failed write raises
:class:`~megatron_pacs.utils.checkpoint_dirs.CheckpointWriteError` there, naming the step and the OS error; the
temporary folder is removed and the checkpoints already in place stay.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.training_checkpoint import WRITE_ERRORS, Extras, _finish, _temp_folder, _write
from megatron_pacs.utils.checkpoint_dirs import CheckpointWriteError, checkpoint_dir
from megatron_pacs.utils.exit_signal import ignore_stop_signals, stop_signals_blocked
from megatron_pacs.utils.interrupts import waiting_for
from megatron_pacs.utils.log_writes import any_rank

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = ["PendingCheckpoint", "start_training_checkpoint", "wait_for_removals"]


class PendingCheckpoint:
    """A checkpoint whose shards are being written in the background (every call is collective).

    Args:
        save: The checkpoint root.
        step: The step it holds.
        tmp: The temporary folder it is written into.
        metadata: Its metadata (the run's state at ``step``), written at the commit.
        parent: The checkpoint it descends from.
        keep_last: ``--keep-last``, applied at the commit.
        queue: The scheduled writes.
    """

    def __init__(
        self,
        save: str | os.PathLike,
        step: int,
        tmp: str,
        metadata: dict[str, Any],
        *,
        parent: str | os.PathLike | None,
        keep_last: int,
        queue: AsyncCallsQueue,
    ) -> None:
        self.save, self.step, self.tmp, self.metadata = save, step, tmp, metadata
        self.parent, self.keep_last, self.queue = parent, keep_last, queue

    @property
    def path(self) -> Path:
        """The checkpoint's folder once committed (``iter_NNNNNNN``)."""
        return checkpoint_dir(self.save, self.step)

    def finish(self, *, blocking: bool, timeout: float | None = None) -> bool:
        """Commit the checkpoint if every rank's writes are done (``blocking``: wait for them first).

        Args:
            blocking: Wait for the writes.
            timeout: With ``blocking``, wait at most this many seconds for this rank's writer; a writer still
                running on any rank then is ended and the save abandoned (the shutdown's bound).

        Returns:
            True when the checkpoint is in place; False when writes are still going on (never with ``blocking``).

        Raises:
            CheckpointWriteError: when a rank's write failed with an OS error (the step, ``--save`` and the error
                named; the temporary folder removed, the checkpoints in place untouched), or its writer outlasted
                ``timeout``.
        """
        error = None
        if blocking and timeout is not None:
            with waiting_for(f"step {self.step}'s checkpoint writer"):
                late = _join_writers(self.queue, timeout)
            if any_rank(bool(late)):  # every rank abandons the save alike (collective)
                _abort(self.queue)
                self._commit(
                    CheckpointWriteError(
                        f"--save: step {self.step}'s checkpoint writer"
                        f"{f' (pid {late[0]})' if late else ' of another rank'} was still writing {timeout:.0f}s "
                        f"into the shutdown: abandoned, its temporary folder removed; the checkpoints already in "
                        f"{self.save} stay and --load {self.save} resumes from the newest"
                    )
                )  # raises it
        try:
            with cuda_to_cpu():  # Megatron's finalize makes its flags on torch.cuda.current_device()
                self.queue.maybe_finalize_async_calls(blocking=blocking)
            if self.queue.get_num_unfinalized_calls():
                return False
        except WRITE_ERRORS as exc:  # _commit reports an OS error in one line, re-raises any other
            _abort(self.queue)
            error = exc
        self._commit(error)
        if blocking:  # the run's last save, a stop or the shutdown: nothing is left behind
            wait_for_removals()
        return True

    def _commit(self, error: BaseException | None) -> None:
        """:func:`~megatron_pacs.mcore.training_checkpoint._finish` of this save; the folders ``--keep-last``
        prunes are deleted in a background thread (renamed first, they are out of every resume's way)."""
        _finish(
            self.save,
            self.step,
            self.tmp,
            self.metadata,
            parent=self.parent,
            keep_last=self.keep_last,
            error=error,
            remove=_remove_in_background,
        )

    def fail(self, error: BaseException) -> NoReturn:
        """Give this save up after ``error`` on the step's path (collective): its writes ended, its temporary
        folder removed.

        Raises:
            CheckpointWriteError: naming the step and the OS error (``error`` itself when it is not an OS one).
        """
        _abort(self.queue)
        self._commit(error)
        raise error


_removals: list[threading.Thread] = []


def _remove_in_background(folder: Path) -> None:
    """Delete a pruned checkpoint's folder off the step's path (its files can be gigabytes a rank). A process that
    ends first leaves it to the next start, which removes ``.tmp-*`` folders under the run lock."""
    _removals[:] = [t for t in _removals if t.is_alive()]
    thread = threading.Thread(
        target=shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, name="checkpoint-prune", daemon=True
    )
    thread.start()
    _removals.append(thread)


def wait_for_removals() -> None:
    """Wait until every pruned folder handed to the background is deleted."""
    while _removals:
        _removals.pop().join()


def _in_order(requests: list[AsyncRequest]) -> AsyncRequest:
    """One request that writes ``requests`` (the model's, then each extra model's) one after the other in one
    process. Megatron's writers report through one process-wide results queue, which each finalize reads in turn:
    two writes in flight at once would each take the other's results."""
    calls = []
    for request in requests:
        if request.async_fn is None:  # nothing for this rank to write there
            continue
        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # the host copy, on the step's path (as Megatron's scheduler makes it)
            args[1] = request.preload_fn()
        calls.append((request.async_fn, tuple(args), dict(request.async_fn_kwargs)))
    finalize = [fn for request in requests for fn in request.finalize_fns]
    return AsyncRequest(partial(_run_in_order, calls) if calls else None, (), finalize)


def _run_in_order(calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]) -> None:
    # Forked with SIGINT and SIGTERM blocked (start_training_checkpoint): a Ctrl-C reaches the whole process group,
    # and a writer that raised KeyboardInterrupt before posting its results left the trainer's wait for them hanging
    # (issue 53). The rank decides when its save stops; the writer also ends once the rank is gone.
    ignore_stop_signals(parent_pid=os.getppid())
    # The forked writer yields the cores to the training step: a lower priority, and one thread for the host
    # tensors' fingerprint sums (the step's own thread pool was sized for the step)
    os.nice(10)
    torch.set_num_threads(1)
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


def _join_writers(queue: AsyncCallsQueue, timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for this rank's forked writers to end; the pids of those still running."""
    deadline = time.monotonic() + timeout
    late = []
    for call in queue.async_calls:
        process = getattr(call.async_caller, "process", None)  # TemporalAsyncCaller's fork (None: nothing to write)
        if process is None:
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            late.append(process.pid)
    return late


def _abort(queue: AsyncCallsQueue) -> None:
    """End the writes still scheduled after one failed (their folder is about to be removed)."""
    while queue.async_calls:
        queue.async_calls.popleft().async_caller.close(abort=True)


def start_training_checkpoint(
    save: str | os.PathLike,
    step: int,
    models: Sequence[MegatronModule],
    optimizer: Any,
    metadata: dict[str, Any],
    *,
    parent: str | os.PathLike | None = None,
    keep_last: int = 2,
    extra_models: Extras | None = None,
    driver_objects: dict[str, Any] | None = None,
) -> PendingCheckpoint:
    """Start writing ``save/iter_<step>`` in the background (collective; the arguments are
    :func:`~megatron_pacs.mcore.training_checkpoint.save_training_checkpoint`'s).

    Returns:
        The save in flight: call :meth:`PendingCheckpoint.finish` on every rank until it returns True.

    Raises:
        CheckpointWriteError: when the part written on the step's path fails with an OS error.
    """
    _, tmp = _temp_folder(save, step)
    queue = AsyncCallsQueue(persistent=False)
    requests: list[AsyncRequest] = []
    try:
        _write(tmp, models, optimizer, extra_models, driver_objects, requests)
        # the fork starts with the stop signals blocked, and ignores them before it unblocks them (_run_in_order)
        with cuda_to_cpu(), stop_signals_blocked():
            queue.schedule_async_request(_in_order(requests))
    except WRITE_ERRORS as exc:
        _abort(queue)
        _finish(save, step, tmp, metadata, parent=parent, keep_last=keep_last, error=exc)  # raises
        raise
    return PendingCheckpoint(save, step, tmp, metadata, parent=parent, keep_last=keep_last, queue=queue)
