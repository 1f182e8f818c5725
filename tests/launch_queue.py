"""One launch queue for the whole pytest session: every module's trainer launches, two at a time, in test order.

A launch (the real trainer, its fleet and its reward pool) is mostly single-threaded start-up on a 2-core machine,
so two run at once. With a pool per module, the last launch of each module ran alone while the other core idled,
and the next module's launches waited for it. Here every selected module that declares launches has them queued
when the first of them is needed, in the order pytest runs the modules, so a core freed by one module's last
launch starts the next module's first one.

A module declares, at module level:

- ``prepare(root: Path) -> Any``: builds its inputs under ``root`` (its own temporary folder); it runs once, when
  the module is planned, in the planning thread (the session's main thread), and its result is handed to every
  launch of the module. Never in a launch's worker thread: while it loads a model, transformers swaps torch's init
  functions and ``PreTrainedModel.tie_weights`` for no-ops process-wide (``transformers.initialization``'s
  ``no_init_weights`` and ``no_tie_weights``), so a tiny model built in a worker thread while a test loaded another
  in the main thread was saved untied or uninitialised (CI: test_distributed's ``qwen2_tied`` 2.8 off HF's logits);
- ``LAUNCHES: dict[str, Callable[[Any], Any]]``: each launch, by name, from ``prepare``'s result;
- optionally ``LIGHT_LAUNCHES: frozenset[str]``: those of its launches that mostly wait (out a fixed timeout): they
  start beside the slots once the queue is in the foreground, instead of holding a slot while the CPU idles.

Its tests take the ``launched`` fixture of the module (``launch_queue.futures(__name__)``) and read their own
launches' futures: a failed launch fails the tests that read it, with the launch's output.

Every launch's wall time is recorded (:meth:`LaunchQueue.timings`); the session prints them per module at its end
(``pytest_terminal_summary`` in tests/conftest.py), beside ``--durations``.

A launch starts its processes with :func:`run_launch`: in a session of their own, so that the kernel schedules them
as one group (Linux's autogroups) whose priority the queue sets; processes that start sessions of their own
(torchrun's workers do) are found among the launch's descendants every second and get the same priority. In the
background (:meth:`LaunchQueue.background`, while the cluster tests run: their timings are measured) two launches run
at a low priority, on the CPU those tests leave idle; in the foreground two run at the normal priority.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zygote

__all__ = ["LaunchQueue", "run_launch"]

#: The autogroup nice of launches in the background: weight 110 against 1024 at nice 0. Not 19 (weight 15): a launch
#: starved that much let Ray's node start-up time out ("The current node timed out during startup", 44 s).
BACKGROUND_NICE = 10

#: Launches at once in the background. Three: with one, a fifth to a third of the CPU stayed idle while the cluster
#: tests ran (vmstat, 2026-11-29: 65-84% busy), their processes mostly waiting on one another; with two, 72-94% in
#: the minutes of the tests marked ``waits``.
BACKGROUND_SLOTS = 3

_LOCAL = threading.local()  # .queue: the LaunchQueue whose worker thread this is (unset elsewhere)


def _set_group_nice(pid: int, nice: int) -> None:
    """The nice of ``pid``'s autogroup (its session's processes, children included)."""
    with contextlib.suppress(OSError):  # no autogroups in this kernel, or not permitted: plain scheduling
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _descendants(roots: set[int]) -> set[int]:
    """Every living process below ``roots`` (from each process's parent in /proc; a fork server's child counts as the
    child of the process it was forked for, tests/zygote.py)."""
    children: dict[int, list[int]] = {}
    for child, client in zygote.served_children().items():
        children.setdefault(client, []).append(child)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launch's process group and every descendant (those in sessions of their own hold its pipes)."""
    below = _descendants({proc.pid})  # before the kill: orphans leave the tree
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_launch(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` for a launch: from a queue
    worker, in a session of its own at the queue's priority, all its processes killed on a timeout (or when the
    queue closes); elsewhere (a test's own run) plainly."""
    queue: LaunchQueue | None = getattr(_LOCAL, "queue", None)
    if queue is None:
        return zygote.run(cmd, timeout=timeout, **kwargs)
    with queue._gate:
        nice = queue._nice
    proc = zygote.popen(cmd, nice=nice, **kwargs)
    queue._started(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_tree(proc)
        raise
    finally:
        queue._ended(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class _Prepared:
    """A module's ``prepare(root)``, run once, in the thread that plans the module."""

    def __init__(self, prepare: Callable[[Path], Any], root: Path) -> None:
        started = time.perf_counter()
        self._value: Any = None
        self._error: BaseException | None = None
        try:
            self._value = prepare(root)
        except Exception as exc:  # noqa: BLE001 - kept: every launch of the module reports it
            self._error = exc
        self._root = root
        self.seconds = time.perf_counter() - started

    def get(self) -> Any:
        if self._error is not None:
            raise RuntimeError(f"prepare({self._root}) failed") from self._error
        return self._value


class LaunchQueue:
    """Runs the session's launches ``workers`` at a time, first come first served.

    Args:
        workers: Launches at once.
    """

    def __init__(self, workers: int = 2) -> None:
        # a thread per slot, in the background or the foreground: a launch waits in the pool's queue (in order)
        # until a thread is free, then at most one waits at the gate for a slot
        self._pool = ThreadPoolExecutor(max_workers=max(workers, BACKGROUND_SLOTS), thread_name_prefix="launch")
        self._light = ThreadPoolExecutor(max_workers=2, thread_name_prefix="launch-light")
        self._workers = workers
        self._slots, self._nice, self._running = workers, 0, 0
        self._gate = threading.Condition()
        self._live: set[subprocess.Popen] = set()
        self._closed = False
        self._watch = threading.Thread(target=self._watch_sessions, name="launch-priority", daemon=True)
        self._watch.start()
        self._futures: dict[str, dict[str, Future]] = {}
        self._roots: dict[str, Path] = {}
        self._seconds: dict[str, dict[str, float]] = {}
        self._prepared: dict[str, _Prepared] = {}

    def plan(
        self,
        module: str,
        prepare: Callable[[Path], Any],
        launches: dict[str, Callable[[Any], Any]],
        root: Path,
        light: frozenset[str] = frozenset(),
    ):
        """Run ``module``'s ``prepare`` here, in the calling thread, then queue every launch of the module (after all
        that were queued before). ``light``: launches that mostly wait (out a timeout, for a signal): they start
        outside the slots, where their waiting costs no slot, once the queue is in the foreground (a wait that
        measures a start, as Ray's registration time does, is not measured beside the background's load)."""
        prepared = _Prepared(prepare, root)
        self._roots[module], self._prepared[module] = root, prepared
        seconds = self._seconds.setdefault(module, {})

        def run(name: str, launch: Callable[[Any], Any]) -> Any:
            slot = name not in light
            with self._gate:
                self._gate.wait_for(lambda: (self._running < self._slots if slot else self._nice == 0) or self._closed)
                if self._closed:
                    raise RuntimeError("the launch queue closed before this launch started")
                self._running += slot
            _LOCAL.queue = self
            try:
                value = prepared.get()
                started = time.perf_counter()
                try:
                    return launch(value)
                finally:
                    seconds[name] = time.perf_counter() - started
            finally:
                _LOCAL.queue = None
                with self._gate:
                    self._running -= slot
                    self._gate.notify_all()

        unknown = set(light) - set(launches)
        if unknown:
            raise ValueError(f"{module}: light launches {sorted(unknown)} are not among its launches")
        self._futures[module] = {
            name: (self._light if name in light else self._pool).submit(run, name, launch)
            for name, launch in launches.items()
        }

    def futures(self, module: str) -> dict[str, Future]:
        """``module``'s launches by name (queued when the session's first launching module started)."""
        return self._futures[module]

    def root(self, module: str) -> Path:
        """The folder ``module``'s ``prepare`` builds under (its launches' results are complete once read)."""
        return self._roots[module]

    def timings(self) -> dict[str, dict[str, float]]:
        """Wall seconds of every launch that ran, by module then launch name (``(prepare)``: the module's
        ``prepare``), in queue order; a launch that failed counts too."""
        out: dict[str, dict[str, float]] = {}
        for module, seconds in self._seconds.items():
            ran = {name: seconds[name] for name in self._futures[module] if name in seconds}
            if ran:
                out[module] = {"(prepare)": self._prepared[module].seconds, **ran}
        return out

    def background(self, on: bool) -> None:
        """In the background: :data:`BACKGROUND_SLOTS` at once at a low priority (those running now included);
        otherwise ``workers`` at once at the normal priority."""
        if on and os.geteuid() != 0:
            return  # raising a group's priority again needs CAP_SYS_NICE: without it, stay in the foreground
        with self._gate:
            self._slots, self._nice = (BACKGROUND_SLOTS, BACKGROUND_NICE) if on else (self._workers, 0)
            roots = {p.pid for p in self._live}
            self._gate.notify_all()
        for pid in roots | _descendants(roots):
            _set_group_nice(pid, self._nice)

    def _watch_sessions(self) -> None:
        """Every second in the background: its priority for the sessions that the launches' descendants started
        (in the foreground their own, the normal one, is the queue's)."""
        while not self._closed:
            with self._gate:
                roots, nice = {p.pid for p in self._live}, self._nice
            if roots and nice:
                for pid in _descendants(roots):
                    _set_group_nice(pid, nice)
            time.sleep(1.0)

    def _started(self, proc: subprocess.Popen) -> None:
        with self._gate:
            self._live.add(proc)
            _set_group_nice(proc.pid, self._nice)
            closed = self._closed
        if closed:  # started while the queue closed, after close() looked
            _kill_tree(proc)

    def _ended(self, proc: subprocess.Popen) -> None:
        with self._gate:
            self._live.discard(proc)

    def close(self) -> None:
        """Drop the launches that have not started and end those still running (the session no longer needs
        them: a test that read their results ended before, or the session was interrupted)."""
        with self._gate:
            self._closed = True
            live = list(self._live)
            self._gate.notify_all()
        for pool in (self._pool, self._light):
            pool.shutdown(wait=False, cancel_futures=True)
        for proc in live:
            _kill_tree(proc)
        for pool in (self._pool, self._light):
            pool.shutdown(wait=True)
