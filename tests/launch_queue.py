"""One launch queue for the whole pytest session: every module's trainer launches, two at a time, in test order.

A launch (the real trainer, its fleet and its reward pool) is mostly single-threaded start-up on a 2-core machine,
so two run at once. With a pool per module, the last launch of each module ran alone while the other core idled,
and the next module's launches waited for it. Here every selected module that declares launches has them queued
when the first of them is needed, in the order pytest runs the modules, so a core freed by one module's last
launch starts the next module's first one.

A module declares, at module level:

- ``prepare(root: Path) -> Any``: builds its inputs under ``root`` (its own temporary folder); it runs once, in the
  module's first launch to start, and its result is handed to every launch of the module;
- ``LAUNCHES: dict[str, Callable[[Any], Any]]``: each launch, by name, from ``prepare``'s result.

Its tests take the ``launched`` fixture of the module (``launch_queue.futures(__name__)``) and read their own
launches' futures: a failed launch fails the tests that read it, with the launch's output.

Every launch's wall time is recorded (:meth:`LaunchQueue.timings`); the session prints them per module at its end
(``pytest_terminal_summary`` in tests/conftest.py), beside ``--durations``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["LaunchQueue"]


# One prepare at a time: a prepare imports from transformers, whose lazy module is not thread-safe (two threads
# importing its names at once got "cannot import name 'PreTrainedTokenizerFast'"); the launches themselves are
# subprocesses and run two at a time.
_PREPARE_LOCK = threading.Lock()


class _Prepared:
    """A module's ``prepare(root)``, run once by whichever of its launches starts first."""

    def __init__(self, prepare: Callable[[Path], Any], root: Path) -> None:
        self._prepare, self._root = prepare, root
        self._lock = _PREPARE_LOCK
        self._done = False
        self.seconds = 0.0
        self._value: Any = None
        self._error: BaseException | None = None

    def get(self) -> Any:
        with self._lock:
            if not self._done:
                started = time.perf_counter()
                try:
                    self._value = self._prepare(self._root)
                except Exception as exc:  # noqa: BLE001 - kept: every launch of the module reports it
                    self._error = exc
                self.seconds = time.perf_counter() - started
                self._done = True
        if self._error is not None:
            raise RuntimeError(f"prepare({self._root}) failed") from self._error
        return self._value


class LaunchQueue:
    """Runs the session's launches ``workers`` at a time, first come first served.

    Args:
        workers: Launches at once.
    """

    def __init__(self, workers: int = 2) -> None:
        # the names the modules' prepare functions import, imported here in the main thread first, so no test's own
        # import of them in the main thread can race a worker's (transformers' lazy module is not thread-safe)
        from transformers import (  # noqa: F401
            AutoConfig,
            AutoModelForCausalLM,
            AutoTokenizer,
            LlamaConfig,
            PreTrainedTokenizerFast,
            Qwen2Config,
            Qwen3Config,
        )

        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="launch")
        self._futures: dict[str, dict[str, Future]] = {}
        self._roots: dict[str, Path] = {}
        self._seconds: dict[str, dict[str, float]] = {}
        self._prepared: dict[str, _Prepared] = {}

    def plan(self, module: str, prepare: Callable[[Path], Any], launches: dict[str, Callable[[Any], Any]], root: Path):
        """Queue every launch of ``module`` (after all that were queued before)."""
        prepared = _Prepared(prepare, root)
        self._roots[module], self._prepared[module] = root, prepared
        seconds = self._seconds.setdefault(module, {})

        def run(name: str, launch: Callable[[Any], Any]) -> Any:
            value = prepared.get()
            started = time.perf_counter()
            try:
                return launch(value)
            finally:
                seconds[name] = time.perf_counter() - started

        self._futures[module] = {name: self._pool.submit(run, name, launch) for name, launch in launches.items()}

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

    def close(self) -> None:
        """Drop the launches that have not started; wait for those running (each has its own time-out)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
