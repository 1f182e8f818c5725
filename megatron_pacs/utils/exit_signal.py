"""``--exit-signal-handler``: stop every rank at the same step boundary after SIGTERM (a scheduler's preemption).

Each rank records the signal; at every step boundary the ranks agree (a MAX all-reduce of that flag over the
training group passed in), so all stop after the same step, save, and exit 0. A watchdog thread ends the process
when the grace period runs out first (the step in progress is abandoned; the run resumes from the previous
checkpoint). Ray's ``ray.init`` installs a SIGTERM handler of its own in the driver that exits at once; install
this one after the fleet has started so it replaces Ray's.

torch elastic's agent, which gets the same SIGTERM, exits 1 whatever its ranks do; :mod:`megatron_pacs.torchrun`
(the recipes' launcher) exits 0 instead when every local rank reported a clean stop (:func:`report_clean_stop`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["STOPS_ENV", "ExitSignal", "ignore_stop_signals", "report_clean_stop", "stop_signals_blocked"]

log = get_logger("exit_signal")

STOPS_ENV = "MEGATRON_PACS_CLEAN_STOPS"
"""The directory where each rank reports a clean stop on the exit signal (set by :mod:`megatron_pacs.torchrun`)."""


def report_clean_stop() -> None:
    """Tell the launcher this rank stopped on the exit signal and is exiting 0: a file named after ``LOCAL_RANK``
    holding ``LOCAL_WORLD_SIZE``, in :data:`STOPS_ENV`'s directory (nothing without the launcher)."""
    root = os.environ.get(STOPS_ENV)
    if root:
        Path(root, os.environ.get("LOCAL_RANK", "0")).write_text(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def ignore_stop_signals(parent_pid: int | None = None) -> None:
    """Call first in a helper process that a rank starts (a reward worker, a checkpoint writer's queue server).

    A scheduler's SIGTERM (Slurm signals every process of a job step, descendants included) or a Ctrl-C reaches the
    helpers as well as the rank; the rank decides when they stop (with ``--exit-signal-handler`` it finishes the step
    and saves first), so a helper ignores both signals. With ``parent_pid``, a daemon thread ends the helper once that
    process is gone: one with no other way to learn it would otherwise outlive its rank.

    Args:
        parent_pid: The rank's pid, for a helper that must end with it (None: the helper ends by itself).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # started under stop_signals_blocked: a signal held back meanwhile is dropped now that it is ignored
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if parent_pid is not None:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(0)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Start a helper process that calls :func:`ignore_stop_signals` inside this block: SIGTERM and SIGINT are held
    back from the calling thread meanwhile, and the helper inherits that mask (through fork and exec).

    A spawned helper needs seconds of imports before it can ignore the signals, and a signal in that window ended
    it: torch elastic's agent passes the scheduler's SIGTERM on to each rank's whole process group, and when that
    came while a rank started Megatron's checkpoint-writer results server for the save of its clean stop, the server
    died and the save failed in ``SyncManager.start`` (``EOFError`` in ``connection.recv``). Held back, the signal
    stays pending in the helper until it ignores it. The calling process still gets its own signals (another thread
    takes them, or this one once the block ends). multiprocessing's resource tracker is started first: starting it
    unblocks both signals in the calling thread.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        with _stop_handlers_deferred():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _stop_handlers_deferred() -> Iterator[None]:
    """In the main thread: the stop signals' Python handlers run after the block, not inside it.

    The mask holds a signal back from this thread only: another thread (Ray's, a pool's) takes it, and Python then
    runs the handler in the main thread at its next bytecode, inside the block. A Ctrl-C that raised there, in
    ``SyncManager.start`` after the server had started but before its finalizer was registered, left a server that
    ignores stop signals and a rank that joined it forever at its exit (tools/ctrl_c_probe.py, 1 of 50 trials). A
    signal received meanwhile is recorded and handed to the handler it was meant for once the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(received):
            handler = handlers[signal.Signals(sig)]
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(sig)


class ExitSignal:
    """A SIGTERM latch with a grace-period watchdog (see the module docstring).

    Args:
        grace_seconds: Seconds from the signal to the end of the process, whatever happens.
        signum: The signal to handle.
    """

    def __init__(
        self,
        grace_seconds: float,
        signum: int = signal.SIGTERM,
    ) -> None:
        self.grace_seconds, self.signum = grace_seconds, signum
        self.received_at: float | None = None
        self._event = threading.Event()
        self._done = threading.Event()
        signal.signal(signum, self._handle)
        self._watchdog = threading.Thread(target=self._watch, name="exit-signal-watchdog", daemon=True)
        self._watchdog.start()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            log.warning(
                "exit signal: got %s; stopping after the step in progress (grace period %.0fs)",
                signal.Signals(signum).name,
                self.grace_seconds,
            )
            self._event.set()

    def _watch(self) -> None:
        self._event.wait()
        if self._done.wait(self.grace_seconds):
            return
        log.error(
            "exit signal: the grace period of %.0fs ran out before the step boundary; abandoning the step in "
            "progress (a restart resumes from the previous checkpoint)",
            self.grace_seconds,
        )
        os._exit(1)  # the driver's Ray Client session ends with it, and Ray releases the job's actors

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective over ``group``: whether any rank got the signal (every rank gets the same answer)."""
        import torch  # here: a process that only reports a clean stop (report_clean_stop) needs no torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.received_at is not None else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def seconds_left(self) -> float:
        """Seconds of the grace period left (the full period before any signal)."""
        if self.received_at is None:
            return self.grace_seconds
        return self.grace_seconds - (time.monotonic() - self.received_at)

    def finish(self) -> None:
        """The process is exiting on its own: stop the watchdog (the handler stays: a second signal only logs)."""
        self._done.set()
        self._event.set()
