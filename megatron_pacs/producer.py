"""The step's rollouts, now or one step off: the driver generates step k+1's while every rank trains on step k's.

The driver (rank 0) runs the rollout source (:class:`~megatron_pacs.sources.FleetSource`: generate through the
fleet, score, pack) in a background thread; the thread mostly waits on Ray, so the trainer's main thread keeps the
GIL for Megatron. Weights move to the engines only after that generation has finished, so step k+1's rollouts come from
the weights one update old (docs/algorithm.md §5.1), and an engine restarted mid-generation is re-synced to those
same weights (the fleet replays its last update, which is still the old one).

:class:`RolloutProducer` also times its own calls and records when generation ran, so a step can report how much of
it was hidden behind training (``perf/time/overlap_hidden``) and how long either side waited
(``perf/time/idle_trainer``, ``perf/time/idle_engines``): :meth:`RolloutProducer.step_metrics`. Every rank holds
one; only the driver's has a source to run, so the others' calls do nothing and return None.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources import StepRollouts
from megatron_pacs.sources.filtering import GroupFilter, Refill

__all__ = ["Generated", "RolloutProducer", "overlap_metrics"]


@dataclass
class Generated:
    """A finished generation: the rollouts, the step they are for, the engines' weights (the number of the training
    step that produced them; 0 = the initial ones), and when generation ran (perf_counter)."""

    rollouts: StepRollouts
    step: int
    version: int
    started: float = 0.0
    finished: float = 0.0


class RolloutProducer:
    """``collect(rows, step) -> StepRollouts`` now (:meth:`run`) or in a background thread (:meth:`submit`, then
    :meth:`take`); at most one generation in flight. The trainer's step calls :meth:`rollouts`, :meth:`ahead`,
    :meth:`drain` and :meth:`step_metrics`, which time themselves.

    Args:
        collect: The driver's rollout source's ``collect``; None on the other ranks (every call then does nothing).
        guard: Wraps each call that waits on the rollout side (the trainer's: after the exit signal, a failure
            there is the job's stop).
        engines: The source generates with engines: :meth:`step_metrics` reports how long they and the trainer
            waited for each other.
        group_filter: ``--filter-groups``: drops groups and refills the batch around ``collect``
            (:class:`~megatron_pacs.sources.filtering.GroupFilter`), drawing the refill prompts from the ``refill``
            stream each call passes; None: ``collect`` alone.

    The refill prompts are drawn in the thread that generates (the background one, one step off), while the main
    thread leaves the stream alone until :meth:`drain`: the stream's position after a drain covers them.
    """

    def __init__(
        self,
        collect: Callable[..., StepRollouts] | None,
        *,
        guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        engines: bool = True,
        group_filter: GroupFilter | None = None,
    ) -> None:
        self._collect, self._guard, self._engines, self._filter = collect, guard, engines, group_filter
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._future: Future[Generated] | None = None
        self.done: Generated | None = None
        """A finished generation not yet consumed (what a checkpoint keeps)."""
        self._ran: list[Generated] = []  # the generations that ran during the current step
        self._waited = 0.0  # the trainer's wait for rollouts during the current step

    @property
    def driver(self) -> bool:
        """This rank runs the source."""
        return self._collect is not None

    def start(self, loader: object) -> None:
        """Nothing to start: this producer generates when the step asks (the stream's producer starts a thread)."""

    def rollouts(
        self, rows: list[PromptRow] | None, step: int, version: int, *, refill: Refill | None = None
    ) -> Generated | None:
        """Step ``step``'s rollouts: generated now from ``rows`` (and ``refill``'s prompts, filtering) with weights
        ``version``, or, with ``rows`` None, the ones generated ahead (one step off, or restored from a checkpoint).
        None off the driver."""
        if not self.driver:
            return None
        started = time.perf_counter()
        with self._guard():
            if rows is None:
                gen = self.take(step)
            else:
                gen = self.run(rows, step, version, refill=refill)
                self._ran.append(gen)
        self._waited += time.perf_counter() - started
        return gen

    def ahead(self, rows: list[PromptRow], step: int, version: int, *, refill: Refill | None = None) -> None:
        """Start generating step ``step``'s rollouts in the background (the driver; no-op elsewhere)."""
        if self.driver:
            self.submit(rows, step, version, refill=refill)

    def drain(self) -> None:
        """Wait for the generation in flight (before the weights change under it); it stays :attr:`done`."""
        if not self.in_flight:
            return
        started = time.perf_counter()
        with self._guard():
            self._ran.append(self.wait())
        self._waited += time.perf_counter() - started

    def step_metrics(self, gen: Generated, train: tuple[float, float], step: tuple[float, float]) -> dict[str, float]:
        """The step's rollout-side timing, and how many updates old its rollouts' weights were; starts the next
        step's records.

        Args:
            gen: This step's rollouts.
            train: ``(start, end)`` of this step's update.
            step: ``(start, end)`` of the whole step.
        """
        metrics = overlap_metrics(self._ran, train, step, self._waited) if self._engines else {}
        metrics["rollout/policy_lag"] = float(gen.step - 1 - gen.version)
        self._ran, self._waited = [], 0.0
        return metrics

    def _timed(self, rows: list[PromptRow], step: int, version: int, refill: Refill | None) -> Generated:
        if self._collect is None:
            raise RuntimeError("only the driver's producer has a rollout source to run")
        started = time.perf_counter()
        if self._filter is None:
            rollouts = self._collect(rows, step)
        else:
            rollouts = self._filter(self._collect, rows, step, refill)
        return Generated(rollouts, step, version, started, time.perf_counter())

    def run(self, rows: list[PromptRow], step: int, version: int, *, refill: Refill | None = None) -> Generated:
        """Generate step ``step``'s rollouts from ``rows`` (and ``refill``'s prompts, filtering) now, in this
        thread, with weights ``version``."""
        return self._timed(rows, step, version, refill)

    def submit(self, rows: list[PromptRow], step: int, version: int, *, refill: Refill | None = None) -> None:
        """Start generating step ``step``'s rollouts in the background (filtering, ``refill`` is then called from
        that thread)."""
        if self._future is not None or self.done is not None:
            raise RuntimeError("a generation is already in flight or not yet consumed")
        self._future = self._pool.submit(self._timed, rows, step, version, refill)

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def wait(self) -> Generated:
        """Block until the generation in flight is done; it stays available as :attr:`done` until taken."""
        if self._future is not None:
            self.done, self._future = self._future.result(), None
        if self.done is None:
            raise RuntimeError("no generation was submitted")
        return self.done

    def take(self, step: int) -> Generated | None:
        """The finished generation for ``step`` (waiting for it if in flight), or None if there is none."""
        if self._future is None and self.done is None:
            return None
        done = self.wait()
        if done.step != step:
            raise RuntimeError(f"the generation in flight is for step {done.step}, not {step}")
        self.done = None
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Stop the background thread (idempotent).

        Args:
            timeout: Seconds to wait for a generation in flight; None waits as long as it takes. One still running
                after it is left to end on its own (stopping the fleet makes it fail at once).

        Returns:
            Whether no generation was left running.
        """
        future = self._future
        finished = future is None or timeout is None or not wait([future], timeout=timeout).not_done
        self._pool.shutdown(wait=finished, cancel_futures=True)
        return finished


def overlap_metrics(
    gens: list[Generated], train: tuple[float, float], step: tuple[float, float], waited: float
) -> dict[str, float]:
    """Timing of one step (seconds).

    Args:
        gens: The generations that ran during this step (this step's own when generated now, and the next
            step's when generated in the background).
        train: ``(start, end)`` of this step's update on the driver.
        step: ``(start, end)`` of the whole step.
        waited: Seconds the trainer spent waiting for rollouts (generating them now, or waiting for the
            background generation to finish before the weight sync).

    Returns:
        ``perf/time/overlap_hidden`` (generation that ran while the trainer trained), ``perf/time/idle_trainer``
        (``waited``), ``perf/time/idle_engines`` (the step's time no generation ran).
    """
    hidden = sum(max(0.0, min(g.finished, train[1]) - max(g.started, train[0])) for g in gens)
    generating = sum(max(0.0, min(g.finished, step[1]) - max(g.started, step[0])) for g in gens)
    return {
        "perf/time/overlap_hidden": hidden,
        "perf/time/idle_trainer": waited,
        "perf/time/idle_engines": max(0.0, step[1] - step[0] - generating),
    }
