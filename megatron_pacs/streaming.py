"""Asynchronous rollouts beside the trainer (``--max-staleness K``): a thread runs the stream's rounds across steps.

The driver's :class:`StreamProducer` runs :class:`~megatron_pacs.sources.stream.RolloutStream` in a background
thread: admit the prompts the budget allows, generate one round, score the groups it finished, again. The trainer's
step takes its B groups (:meth:`StreamProducer.rollouts`), trains while the stream goes on under the weights it
had, and before the weight sync stops the stream at the next round boundary (:meth:`StreamProducer.drain`): the
update lands between two rounds, and the stream resumes under it when the next step takes its groups.

With ``--deterministic-mode`` the stream does not run freely: between two updates it runs rounds until the next
step's groups are ready (or nothing is left to run), whatever the trainer's timing, so updates land at the same
rounds in every run and the sampled tokens repeat (on CPU, bit for bit; resumed too).

What a checkpoint keeps: the stream's groups, counters and the loader's position, snapshotted when a step takes its
groups and when the stream stops before the sync, each for the step whose update it goes with
(:meth:`StreamProducer.kept`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.producer import Generated
from megatron_pacs.sources.stream import RolloutStream, stream_rollouts
from megatron_pacs.utils.logging import get_logger

__all__ = ["StreamProducer"]

log = get_logger(__name__)


class StreamProducer:
    """The trainer's side of the asynchronous stream (the driver; see the module docstring).

    Args:
        cfg: The run's settings (``TrainConfig``).
        tokenizer: The model's tokenizer.
        generate: The fleet's ``generate``.
        score: The reward pool's ``score`` (its result has ``scores``).
        guard: Wraps each call that waits on the rollout side (as :class:`~megatron_pacs.producer.RolloutProducer`).
    """

    streams = True

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        generate: Callable[..., list[Any]],
        score: Callable[[list[str], list[str]], Any],
        *,
        guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.cfg, self.tokenizer, self._generate, self._score, self._guard = cfg, tokenizer, generate, score, guard
        self.policy = cfg.rollout.staleness_policy
        self.deterministic = bool(cfg.model.deterministic_mode)
        self.stream: RolloutStream | None = None
        self.loader: PromptLoader | None = None
        self._restored: dict[str, Any] | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = self._running = self._started = False
        self._paused = True
        self._error: BaseException | None = None
        self._version, self._next_step = 0, 1
        self._kept: dict[int, dict[str, Any]] = {}  # step -> the snapshot that goes with its update
        self._busy: list[tuple[float, float]] = []  # the rounds' (start, end) since the last step's metrics
        self._waited = 0.0
        self._paced = 0
        self._last = {"dropped": 0, "filtered": 0, "rounds": 0}

    @property
    def driver(self) -> bool:
        return True

    @property
    def done(self) -> None:
        """Nothing is generated ahead outside the stream (the one-step-off producer's attribute)."""
        return None

    # -- start, restore ----------------------------------------------------------------------------------------

    def restore(self, state: dict[str, Any] | None, step: int) -> None:
        """A checkpoint's snapshot (:meth:`kept`) to continue from, at step ``step`` (before :meth:`start`)."""
        self._restored = state
        self._version, self._next_step = step, step + 1
        if state is not None:
            self._kept[step] = state

    def start(self, loader: PromptLoader) -> None:
        """Build the stream on ``loader`` (already at the resumed position) and start its thread, which generates
        nothing until the first step takes its groups (the run's first validation has the fleet to itself)."""
        self.loader = loader
        self.stream = RolloutStream(self.cfg, self.tokenizer, loader.next_rows)
        if self._restored is not None:
            self.stream.load_state_dict(self._restored["stream"])
        c = self.stream.counters  # the step's deltas count from the restored counters, not from zero
        self._last = {"dropped": c.dropped, "filtered": c.filtered, "rounds": c.rounds}
        self._kept.setdefault(self._next_step - 1, self._snapshot())
        self._thread = threading.Thread(target=self._loop, name="rollout-stream", daemon=True)
        self._thread.start()

    # -- the thread --------------------------------------------------------------------------------------------

    def _work(self) -> bool:
        """Whether the stream has something to do now (call with the lock held)."""
        s = self.stream
        assert s is not None
        if self._closed or self._error is not None or not self._started:
            # nothing before the first step takes its groups: the fleet is the start's validation's until then
            return False
        if self.deterministic:
            if s.takeable(self._next_step):
                return False  # the next step's groups are ready: the update lands here in every run
        elif self._paused:
            return False
        unscored = any(g.finished and g.rewards is None for g in s.groups)
        return bool(s.open_responses()) or s.budget(self._version) > 0 or unscored

    def _loop(self) -> None:
        s = self.stream
        assert s is not None
        try:
            while True:
                with self._cv:
                    paced = False  # one count per wait, however often it wakes
                    while not self._closed and not self._work():
                        # the budget holds admission back while the trainer waits
                        paced = paced or (
                            not self._paused and s.stuck(self._version) and not s.takeable(self._next_step)
                        )
                        self._cv.wait()
                    self._paced += paced
                    if self._closed:
                        return
                    s.admit(self._version)
                    todo, prompts, sampling = s.round_request()
                    version, self._running, started = self._version, True, time.perf_counter()
                outputs = self._generate(prompts, sampling) if todo else []
                with self._cv:
                    if todo:
                        s.apply_round(todo, outputs, version)
                    finished = [g for g in s.groups if g.finished and g.rewards is None]
                texts, truths = s.texts(finished)
                scores = list(self._score(texts, truths).scores) if finished else []
                with self._cv:
                    s.scored(finished, texts, scores)
                    self._running = False
                    self._busy.append((started, time.perf_counter()))
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next call, which raises it
            with self._cv:
                self._error, self._running = exc, False
                self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _snapshot(self) -> dict[str, Any]:
        assert self.stream is not None and self.loader is not None
        return {"stream": self.stream.state_dict(), "loader": self.loader.state_dict()}

    # -- the trainer's calls -----------------------------------------------------------------------------------

    def rollouts(self, rows: Any, step: int, version: int, *, refill: Any = None) -> Generated:
        """Step ``step``'s B groups, taken from the stream under weights ``version`` (waiting for them); the stream
        then goes on under those weights."""
        if rows is not None:
            raise RuntimeError("the stream draws its own prompts: pass rows=None")
        s = self.stream
        assert s is not None, "start() the stream first"
        started = time.perf_counter()
        with self._guard(), self._cv:
            self._version, self._next_step, self._paused, self._started = version, step, False, True
            self._cv.notify_all()
            while not s.takeable(step):
                self._raise()
                s.check_filtering(step)
                if self.policy == "drop" and s.drop_due(step):
                    self._cv.notify_all()
                    continue
                self._cv.wait()
            groups = s.take(step)
            self._next_step = step + 1
            self._kept = {k: v for k, v in self._kept.items() if k >= step - 1}
            self._kept[step] = self._snapshot()
            self._cv.notify_all()
        self._waited += time.perf_counter() - started
        rollouts = stream_rollouts(groups, step, s.eos)
        oldest = min(g.version for g in groups)
        return Generated(rollouts, step, oldest, started, time.perf_counter())

    def ahead(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("--max-staleness runs no separate generation ahead")

    def drain(self) -> None:
        """Stop the stream at the next round boundary (with --deterministic-mode: once the next step's groups are
        ready, or nothing is left to run) before the weights change; snapshot it for this step's checkpoint.

        A failure of the stream's thread is not raised here but by the next step's :meth:`rollouts`: every other
        rank is on its way into the weight sync's gathers now, and waits for the driver's rollouts then, where
        a lost rollout cluster (``--rollout-cluster-reconnect-seconds``) stops every rank alike. The weight sync
        in between skips a fleet that is lost; the snapshot is whole (a failed round leaves the stream as it was
        before it)."""
        started = time.perf_counter()
        with self._cv:
            self._paused = True
            while self._running or (self.deterministic and self._work()):
                self._cv.wait()
            if self._error is not None:
                log.warning("rollout stream: stopped by %r; the next step, if any, raises it", self._error)
            self._kept[self._next_step - 1] = self._snapshot()
        self._waited += time.perf_counter() - started

    def kept(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint of step ``step`` keeps: the stream and the loader's position that go with that step's
        update (or None when there is none: nothing was taken since)."""
        return self._kept.get(step)

    def step_metrics(self, gen: Generated, train: tuple[float, float], step: tuple[float, float]) -> dict[str, float]:
        """The step's stream metrics: staleness (in the rollouts' own metrics), queue, drops, filtered groups,
        rounds, admission waits, and the engines' and trainer's idle time; starts the next step's records."""
        s = self.stream
        assert s is not None
        with self._cv:
            c = s.counters
            now = {"dropped": c.dropped, "filtered": c.filtered, "rounds": c.rounds}
            delta = {k: float(now[k] - self._last[k]) for k in now}
            self._last = now
            busy, self._busy = self._busy, []
            queue, live, paced = len(s.ready()), len(s.groups), self._paced
            self._paced = 0
        generating = sum(max(0.0, min(b, step[1]) - max(a, step[0])) for a, b in busy)
        hidden = sum(max(0.0, min(b, train[1]) - max(a, train[0])) for a, b in busy)
        metrics = {
            "rollout/dropped_groups": delta["dropped"],
            "rollout/filtered_groups": delta["filtered"],
            "rollout/stream_rounds": delta["rounds"],
            "rollout/queue_depth": float(queue),
            "rollout/live_groups": float(live),
            "rollout/admission_waits": float(paced),
            "rollout/policy_lag": float(gen.step - 1 - gen.version),
            "perf/time/overlap_hidden": hidden,
            "perf/time/idle_trainer": self._waited,
            "perf/time/idle_engines": max(0.0, step[1] - step[0] - generating),
        }
        self._waited = 0.0
        return metrics

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread (idempotent); True when no round was left running after ``timeout`` seconds."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
