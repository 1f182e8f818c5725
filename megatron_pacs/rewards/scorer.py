"""Score a batch of responses in a pool of worker processes, with a hard per-item timeout.

``concurrent.futures`` cannot stop a task that hangs (a pathological LaTeX parse can run for minutes), so each
worker here has its own pipe and the parent enforces a deadline per item: a worker past its deadline is killed
and replaced, its item scores 0.0 and is counted as a timeout. A worker that dies scores its item 0.0 as an
error. Every worker killed or found dead and replaced is counted (``reward/worker_restarts``). The step is never held
longer than about ``timeout_s`` per item. Each worker has its own start-up deadline
from the moment it is (re)started, so replacing every worker at once (hangs late in a long batch) cannot end the
run; only a pool none of whose workers ever starts raises.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from megatron_pacs.config.reward_fn import load_reward_fn
from megatron_pacs.rewards.math_verify import ERROR, OK, TIMEOUT, TOO_LONG, VERIFY_TIMEOUT, score_with_status
from megatron_pacs.utils.exit_signal import ignore_stop_signals, stop_signals_blocked
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from megatron_pacs.config.run import RewardConfig

__all__ = ["RewardScorer", "ScoreResult", "reward_value"]

log = get_logger("rewards")

RewardFn = Callable[[Any, Any], Any]
"""``fn(response, ground_truth)``: a number in [0, 1] or a bool (:func:`reward_value`); the built-in math-verify
reward alone returns ``(score, status)``."""


@dataclass
class ScoreResult:
    """Scores of one batch, in input order, with the failure counts.

    Attributes:
        scores: One float per response.
        num_errors: Items scored 0.0 because of an error (bad input, an exception, a crashed worker).
        num_timeouts: Items scored 0.0 because they ran past the timeout.
        num_too_long: Items scored 0.0 without parsing because they exceed ``max_chars``.
        num_verify_timeouts: Items scored 0.0 because math-verify's own time limit (~5 s) cut them short.
        statuses: Per item ``"ok"``, ``"error"``, ``"timeout"``, ``"too_long"`` or ``"verify_timeout"``.
        num_worker_restarts: Workers replaced while scoring this batch (killed past a deadline, or found dead).
    """

    scores: list[float]
    num_errors: int = 0
    num_timeouts: int = 0
    num_too_long: int = 0
    statuses: list[str] = field(default_factory=list)
    num_verify_timeouts: int = 0
    num_worker_restarts: int = 0

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/mean`` and the failure counts, for the metric logger."""
        return {
            f"{prefix}/mean": sum(self.scores) / len(self.scores) if self.scores else 0.0,
            f"{prefix}/num_errors": float(self.num_errors),
            f"{prefix}/num_timeouts": float(self.num_timeouts),
            f"{prefix}/num_too_long": float(self.num_too_long),
            f"{prefix}/num_verify_timeouts": float(self.num_verify_timeouts),
            f"{prefix}/worker_restarts": float(self.num_worker_restarts),
        }


def reward_value(out: Any) -> tuple[float, str | None]:
    """A reward function's return value as a score, by the documented rule (docs/training.md, "Your own reward").

    A bool is 1.0 (True) or 0.0 (False); an int or a float (any ``numbers.Real``, NumPy's scalars included) is
    itself when it is finite and within [0, 1]. Anything else (a string such as ``"1"``, None, a tuple, a tensor,
    NaN, 2.0) is not a score: 0.0, with why.

    Returns:
        ``(score, None)``, or ``(0.0, why)`` for a value that is not a score.
    """
    if isinstance(out, bool):
        return float(out), None
    if not isinstance(out, numbers.Real):
        return 0.0, f"returned a {type(out).__name__} ({_short(out)}), not a number"
    score = float(out)
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        return 0.0, f"returned {score!r}, outside [0, 1]"
    return score, None


def _short(value: Any, limit: int = 60, *, text: bool = False) -> str:
    """``value``'s repr (``text``: its str), cut to ``limit`` characters."""
    out = str(value) if text else repr(value)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _error_kind(error: str) -> str:
    """What :meth:`RewardScorer._show_errors` shows once: an exception's type, or the kind of value returned."""
    if error.startswith("raised "):
        return error.split(":", 1)[0]
    if error.endswith("outside [0, 1]"):
        return "outside [0, 1]"
    return error.split(" (", 1)[0]


def _call(fn: RewardFn, response: Any, ground_truth: Any) -> tuple[float, str, str | None]:
    """``fn``'s score, status and, for an error, what went wrong.

    The built-in math-verify reward (:func:`score_with_status`) returns ``(score, status)`` itself; any other
    function returns a reward read by :func:`reward_value`. An exception, or a value that is not a score, is 0.0
    and an error.
    """
    try:
        out = fn(response, ground_truth)
    except Exception as exc:  # noqa: BLE001 - a reward that raises scores 0 and is counted
        return 0.0, ERROR, f"raised {type(exc).__name__}: {_short(exc, 200, text=True)}"
    if fn is score_with_status:
        return out[0], out[1], None
    score, why = reward_value(out)
    return (score, OK, None) if why is None else (0.0, ERROR, why)


def _worker_main(conn: Connection, fn: RewardFn | str) -> None:
    """Worker loop: say ready, then answer ``(idx, response, gt)`` with ``(idx, score, status, error)``.

    Only the built-in math-verify reward is warmed up first (its import and verifier, before the first timed item);
    a user's function is never called but on the items (a slow one would cost its time-out again at every
    replacement of a worker).
    """
    ignore_stop_signals()  # the trainer decides when the pool stops; a worker ends on its pipe's end (EOFError)
    if isinstance(fn, str):  # --reward-fn: found by name here (the parent checked that it imports)
        fn = load_reward_fn(fn)
    if fn is score_with_status:
        _call(fn, "\\boxed{1}", "1")
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        idx, response, ground_truth = msg
        conn.send((idx, *_call(fn, response, ground_truth)))


class _Worker:
    def __init__(self, ctx, fn: RewardFn | str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fn), daemon=True, name="megatron_pacs-reward")
        with stop_signals_blocked():  # a SIGTERM to the process group while it imports must not end it
            self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.item: tuple[int, float] | None = None  # (index, deadline) of the item in flight

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardScorer:
    """A reusable pool that scores (response, ground truth) pairs with a per-item timeout.

    Args:
        num_workers: Worker processes; 0 scores serially in this process (math-verify's own time limits only,
            no hard timeout).
        timeout_s: Wall-clock limit per item, measured from when a ready worker receives it.
        reward_fn: A picklable ``(response, ground_truth) -> float | bool``, or a ``module:function`` /
            ``path/to/file.py:function`` that each worker imports (``--reward-fn``); default math-verify. A value
            that is no score by :func:`reward_value`'s rule (a string, NaN, 2.0) is 0.0, counted as an error; the
            first error of each kind is logged once, with the item.
        start_timeout_s: How long a worker may take to import the reward (math-verify: and warm up), from its own
            (re)start; one that does not is restarted, and only when no worker has started within it does
            ``score`` raise.
        max_chars: Responses longer than this score 0.0 unparsed (status ``too_long``, counted); None disables
            the guard (``--reward-max-chars``).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        reward_fn: RewardFn | str = score_with_status,
        start_timeout_s: float = 120.0,
        max_chars: int | None = 100_000,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0 (0 scores in this process)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_chars={max_chars} must be >= 1 (None disables the guard)")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.reward_fn = reward_fn
        # the function itself for serial scoring; a name is imported here first, so a bad one fails now
        self._fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.start_timeout_s = start_timeout_s
        self.max_chars = max_chars
        self.total_errors = 0
        self.total_timeouts = 0
        self.total_too_long = 0
        self.total_verify_timeouts = 0
        self.total_worker_restarts = 0
        self._restarts = 0  # workers replaced in the batch being scored
        self._shown: set[str] = set()  # the kinds of reward errors already shown (each once per pool)
        # spawn, not fork: the trainer process holds threads (Ray, torch) that fork would copy half-initialised.
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardScorer:
        """The pool ``--reward-*`` describe: ``--reward-fn`` (math-verify without it), workers, time-out, cap."""
        return cls(
            num_workers=reward.reward_workers,
            timeout_s=reward.reward_timeout,
            reward_fn=reward.reward_fn or score_with_status,
            max_chars=reward.reward_max_chars or None,
        )

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.kill()
        self._workers = []

    def score(self, responses: Sequence[Any], ground_truths: Sequence[Any]) -> ScoreResult:
        """Score ``responses[i]`` against ``ground_truths[i]``.

        Args:
            responses: Decoded responses; a non-string scores 0.0 as an error.
            ground_truths: Final answers (strings or numbers), one per response.

        Returns:
            A :class:`ScoreResult` in input order.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"got {len(responses)} responses but {len(ground_truths)} ground truths; pass one ground truth per "
                "response (repeat a prompt's answer for each of its samples)"
            )
        results: list[tuple[float, str, str | None] | None] = [None] * len(responses)
        self._restarts = 0
        todo: deque[int] = deque()
        for i, resp in enumerate(responses):
            if not isinstance(resp, str):
                results[i] = (0.0, ERROR, None)
            elif self.max_chars is not None and len(resp) > self.max_chars:
                results[i] = (0.0, TOO_LONG, None)
            else:
                todo.append(i)
        if self.num_workers == 0:
            for i in todo:
                results[i] = _call(self._fn, responses[i], ground_truths[i])
        elif todo:
            self._run_pool(todo, responses, ground_truths, results)
        scores = [r[0] for r in results]  # type: ignore[index]
        statuses = [r[1] for r in results]  # type: ignore[index]
        self._show_errors([r[2] for r in results])  # type: ignore[index]
        out = ScoreResult(
            scores,
            statuses.count(ERROR),
            statuses.count(TIMEOUT),
            statuses.count(TOO_LONG),
            statuses,
            num_verify_timeouts=statuses.count(VERIFY_TIMEOUT),
            num_worker_restarts=self._restarts,
        )
        self.total_errors += out.num_errors
        self.total_timeouts += out.num_timeouts
        self.total_too_long += out.num_too_long
        self.total_verify_timeouts += out.num_verify_timeouts
        self.total_worker_restarts += out.num_worker_restarts
        if out.num_errors or out.num_timeouts or out.num_too_long or out.num_verify_timeouts:
            log.warning(
                "reward: %d errors, %d timeouts (> %.1fs), %d over %s chars (--reward-max-chars), %d stopped by "
                "math-verify's own time limit, among %d items; all scored 0.0",
                out.num_errors,
                out.num_timeouts,
                self.timeout_s,
                out.num_too_long,
                self.max_chars,
                out.num_verify_timeouts,
                len(scores),
            )
        return out

    def _show_errors(self, errors: Sequence[str | None]) -> None:
        """Log the first error of each kind (an exception's type, a kind of value that is no score) once per pool,
        with the item; the rest only count in ``reward/num_errors``."""
        for i, error in enumerate(errors):
            if error is None:
                continue
            kind = _error_kind(error)
            if kind in self._shown:
                continue
            self._shown.add(kind)
            name = f"--reward-fn {self.reward_fn}" if isinstance(self.reward_fn, str) else "the reward"
            log.warning(
                "reward: %s %s on item %d of the batch, scored 0.0 (shown once; later ones only count in "
                "reward/num_errors)",
                name,
                error,
                i,
            )

    def _ensure_workers(self) -> None:
        """Start the pool's missing workers; one that died since the last batch (killed from outside) is counted."""
        for w in self._workers:
            if not w.proc.is_alive():
                log.warning("reward worker pid %s died (exit code %s): restarting it", w.proc.pid, w.proc.exitcode)
                w.conn.close()
                self._restarts += 1
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.reward_fn))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.reward_fn)
        self._restarts += 1

    def _check_start_up(self, now: float) -> None:
        """Raise when every worker is past its own start-up deadline (each counts from that worker's start, so
        replacing all of them at once costs no run); restart a late one while others work."""
        late = [w for w in self._workers if not w.ready and now > w.started + self.start_timeout_s]
        if late and len(late) == len(self._workers):
            raise RuntimeError(
                f"no reward worker started within {self.start_timeout_s}s; check that the reward imports in a fresh "
                "process (python -c 'import math_verify', or --reward-fn's module) or raise start_timeout_s"
            )
        for w in late:
            log.warning(
                "reward worker pid %s did not start within %.0fs: restarting it", w.proc.pid, self.start_timeout_s
            )
            self._replace(w)

    def _run_pool(self, todo: deque[int], responses, ground_truths, results) -> None:
        self._ensure_workers()
        while todo or any(w.item is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.item is None and todo:
                    i = todo.popleft()
                    w.conn.send((i, responses[i], ground_truths[i]))
                    w.item = (i, now + self.timeout_s)
            self._check_start_up(now)
            deadlines = [w.item[1] for w in self._workers if w.item is not None]
            deadlines += [w.started + self.start_timeout_s for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.5
            for conn in wait([w.conn for w in self._workers], timeout=wait_s):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    msg = w.conn.recv()  # w.conn is conn (wait() types its result as Connection | socket | int)
                except (EOFError, OSError):  # the worker died: its item is an error, the worker is replaced
                    if w.item is not None:
                        results[w.item[0]] = (0.0, ERROR, f"crashed its worker (exit code {w.proc.exitcode})")
                    self._replace(w)
                    continue
                if msg == "ready":
                    w.ready = True
                else:
                    idx, score, status, error = msg
                    results[idx] = (score, status, error)
                    w.item = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now > w.item[1]:
                    results[w.item[0]] = (0.0, TIMEOUT, None)
                    self._replace(w)
