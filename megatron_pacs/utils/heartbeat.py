"""``--heartbeat-timeout-seconds``: every rank ends within that bound when another rank (or the store) is lost.

While rank 0 generates, the other ranks wait in a collective; a host that vanishes without closing its connections
(power, network) would only be noticed after ``--distributed-timeout-minutes``. Instead every rank publishes a
counter in the job's c10d store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent store, or rank 0's under a plain
``env://`` launch) and watches everyone else's. Each observer compares counters, not clocks: a peer is lost when its
counter has not moved, by the observer's own monotonic clock, for longer than the threshold, measured between
successful reads of the store (an observer that was itself suspended does not blame its peers). A store that does
not answer for as long is lost too, and named as the rank(s) on its host.

The store is reached through a client connection of its own rather than the default process group's store: a call
stuck on a vanished host then blocks only this module's thread, not the training's, and its timeout is this
module's. Store calls are not reliably bounded by that timeout (c10d's client retries), so they run in one thread
(``heartbeat-beat``) and the decisions in another (``heartbeat-watch``) that never touches the store.

On a loss the watcher, in this order: logs one line naming the rank and its host; publishes that verdict so every
other rank names the same one; writes every thread's stack (:class:`~megatron_pacs.utils.stacks.StackDumps`); runs
the cleanups (flushing metrics; bounded); and ends the process with ``os._exit(1)``, since the main thread may be
stuck in C++ where no exception reaches it. Checkpoints are written atomically, so whatever was committed stays.
The driver's cleanup kills its engine actors (Ray would release them only after Ray Client's reconnect grace
period, 30 s after the driver's exit).

A rank whose own exchange with the store has not completed for half the stale time (0.2 ``T``, at most 15 s)
writes every thread's stack and goes on (:meth:`~megatron_pacs.utils.stacks.StackDumps.arm_late_dump`, re-armed
after each exchange): a beat thread starved of the GIL by a long C call, or blocked in a store call, is caught in the
act, where the peers' verdict (0.4 ``T``) would show only their own side.

With ``T`` the timeout: reads every ``i = T/10`` (at most 5 s); a peer is declared lost after ``T - 4 i - T/5`` of
no progress (0.4 ``T``; 30 s of the default 60 s). That leaves room for the peer's last beat and the read and watch
intervals (up to ``3 i``), the exit (``T/5``, at most 10 s: stacks, cleanups, the verdict read by the others) and
``i`` for a launcher to notice: a process, its launcher included, has exited by ``T`` after its peer's last beat.
Each rank writes one key and reads ``world`` keys per interval: at 1,000 ranks and 5 s, 200,000 keys a second at
the store.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.stacks import StackDumps

__all__ = ["EXIT_CODE", "Heartbeat", "Timings"]

log = get_logger("heartbeat")

EXIT_CODE = 1
"""The exit status of a process ended by a lost rank (non-zero: torchrun and schedulers see a failure)."""

DONE = "done"
"""A rank's last beat: it left the run (:meth:`Heartbeat.close`), so the others stop watching it."""


class Store(Protocol):
    """The c10d store calls used here (``torch.distributed.TCPStore`` has them)."""

    def set(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class Timings:
    """The intervals derived from the timeout ``T`` (seconds; see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = min(timeout_s / 10, 5.0)
        self.exit_s = min(timeout_s / 5, 10.0)
        self.stale_s = timeout_s - 4 * self.interval_s - self.exit_s
        # no exchange for this long: this rank's stacks are written, the run goes on (a stall of 15 s is worth a
        # look whatever the timeout)
        self.late_s = min(self.stale_s / 2, 15.0)


def tcp_store_client(host: str, port: int, timeout_s: float) -> Store:
    """A client connection of its own to the job's TCPStore (``MASTER_ADDR:MASTER_PORT``)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)  # pyright: ignore[reportPrivateImportUsage] - public API, re-exported without `as`
    return store


class Heartbeat:
    """Publishes this rank's heartbeat and ends the process when another rank's stops (module docstring).

    Args:
        rank: This rank.
        world_size: Number of ranks.
        addresses: Every rank's host address (names the lost rank's host).
        timeout_s: ``--heartbeat-timeout-seconds``.
        connect: Opens the store client (called in the beat thread, so a store that never answers is caught too).
        store_ranks: The ranks on the store's host (a store that stops answering is named as them).
        store_name: The store's address, for messages.
        prefix: Key prefix: unique per launch (torch elastic's run id and restart count).
        stacks: Where the stacks go before the process ends (None: not written).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        addresses: Sequence[str],
        timeout_s: float,
        connect: Callable[[], Store],
        store_ranks: Sequence[int] = (0,),
        store_name: str = "the c10d store",
        prefix: str = "megatron_pacs/heartbeat",
        stacks: StackDumps | None = None,
    ) -> None:
        self.rank, self.world_size, self.addresses = rank, world_size, tuple(addresses)
        self.timings = Timings(timeout_s)
        self.store_ranks, self.store_name, self.prefix, self.stacks = tuple(store_ranks), store_name, prefix, stacks
        self._connect = connect
        self._cleanups: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fired = False
        self._peers = [r for r in range(world_size) if r != rank]
        started = time.monotonic()
        self._contact = started  # the last successful exchange with the store
        self._store_error: BaseException | None = None
        self._seen: dict[int, tuple[str | None, float]] = {r: (None, started) for r in self._peers}  # value, since
        self._verdict: str | None = None  # a loss another rank published
        self._outbox: list[tuple[str, str]] = []  # keys to publish from the beat thread (the verdict, DONE)
        self._leaving = False  # close() was called: the counter stops, DONE is published
        self._wake = threading.Event()  # the beat thread's next exchange now (something to publish)
        self._left = threading.Event()  # DONE is in the store
        self._beat_thread = threading.Thread(target=self._beat, name="heartbeat-beat", daemon=True)
        self._watch_thread = threading.Thread(target=self._watch, name="heartbeat-watch", daemon=True)

    @classmethod
    def from_environment(
        cls, timeout_s: float, addresses: Sequence[str], stacks: StackDumps | None = None
    ) -> Heartbeat | None:
        """The heartbeat of a rank launched by torchrun or ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``), started; None with one rank, without a rendezvous, or with ``timeout_s`` 0 (off)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not timeout_s or world < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        import socket

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            ip = host
        store_ranks = [r for r, a in enumerate(addresses) if a == ip] or [0]
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        timings = Timings(timeout_s)
        beat = cls(
            rank=int(os.environ["RANK"]),
            world_size=world,
            addresses=addresses,
            timeout_s=timeout_s,
            connect=lambda: tcp_store_client(host, port, timings.stale_s),
            store_ranks=store_ranks,
            store_name=f"the c10d store at {host}:{port}",
            prefix=f"megatron_pacs/heartbeat/{run}",
            stacks=stacks,
        )
        beat.start()
        return beat

    @property
    def fired(self) -> bool:
        """A lost rank was found: this process is ending (its stacks are written, the exit follows)."""
        return self._fired

    def await_exit(self) -> None:
        """Called by the main thread when a failure follows a loss already reported: wait (bounded) for the watch
        thread's exit instead of printing a second, misleading error over the first."""
        self._stop.wait(self.timings.exit_s + 2 * self.timings.interval_s)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/rank{rank}"

    def start(self) -> None:
        self._beat_thread.start()
        self._watch_thread.start()

    def add_cleanup(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` before the process ends on a loss (in a thread, all within the exit budget; errors logged)."""
        self._cleanups.append(fn)

    # -- the threads --------------------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Publish this rank's counter and read everyone's, every interval (may block in a store call)."""
        try:
            store = self._connect()
        except Exception as exc:  # noqa: BLE001 - the watcher reports it once the store is overdue
            self._store_error = exc
            return
        keys = [self._key(r) for r in self._peers]
        verdict_key = f"{self.prefix}/lost"
        late = (
            f"heartbeat: no exchange with {self.store_name} for {self.timings.late_s:.1f}s (the other ranks take "
            f"this one for lost after {self.timings.stale_s:.1f}s; the run goes on)"
        )
        count, present = 0, False
        while not self._stop.is_set():
            self._wake.clear()
            outbox: list[tuple[str, str]] = []
            try:
                with self._lock:
                    leaving, outbox, self._outbox = self._leaving, self._outbox, []
                if not leaving:
                    store.set(self._key(self.rank), str(count))
                for key, value in outbox:
                    store.set(key, value)
                if leaving and (self._key(self.rank), DONE) in outbox:
                    self._left.set()
                    return
                present = present or store.check(keys)
                if present:
                    values: list[str | None] = [v.decode() for v in store.multi_get(keys)]
                else:  # starting: some ranks have not beaten yet
                    values = [store.multi_get([k])[0].decode() if store.check([k]) else None for k in keys]
                verdict = store.multi_get([verdict_key])[0].decode() if store.check([verdict_key]) else None
            except Exception as exc:  # noqa: BLE001 - the watcher decides when a store is lost
                self._store_error = exc
                with self._lock:
                    self._outbox = outbox + self._outbox  # published at the next exchange
                self._wake.wait(self.timings.interval_s)
                continue
            now = time.monotonic()
            if self.stacks is not None and not self._stop.is_set():
                # a stall of this thread (the GIL held through a long C call, a store call blocked) leaves the
                # stacks of that moment, long before a peer would take this rank for lost (0.4 T)
                self.stacks.arm_late_dump(self.timings.late_s, late)
            with self._lock:
                self._contact = now
                self._verdict = verdict
                for peer, value in zip(self._peers, values, strict=True):
                    if value != self._seen[peer][0]:
                        self._seen[peer] = (value, now)
            count += 1
            self._wake.wait(self.timings.interval_s)

    def _watch(self) -> None:
        """Every interval: is the store answering, did another rank publish a loss, has any peer's counter stalled?"""
        t = self.timings
        while not self._stop.wait(t.interval_s):
            with self._lock:
                contact, verdict, seen = self._contact, self._verdict, dict(self._seen)
            overdue = time.monotonic() - contact
            if overdue > t.stale_s:
                if all(seen.get(r, (None, 0.0))[0] == DONE for r in self.store_ranks):
                    return  # the store's host left the run cleanly: its store went with it
                error = f" ({self._store_error})" if self._store_error is not None else ""
                self._fire(self.store_ranks[0], f"{self.store_name} did not answer for {overdue:.1f}s{error}")
                return
            if verdict is not None:
                rank, _, why = verdict.partition(":")
                self._fire(int(rank), why, publish=False)
                return
            for peer, (value, since) in seen.items():
                if value != DONE and contact - since > t.stale_s:
                    self._fire(peer, f"its heartbeat stopped {contact - since:.1f}s ago")
                    return

    def _fire(self, rank: int, why: str, *, publish: bool = True) -> None:
        """End this process on the loss of ``rank`` (module docstring); runs in the watch thread."""
        with self._lock:
            if self._fired:
                return
            self._fired = True
            if publish:  # every other rank names the same rank, even one whose own store connection breaks next
                self._outbox.append((f"{self.prefix}/lost", f"{rank}:{why} (seen by rank {self.rank})"))
                self._wake.set()
        began = time.monotonic()
        host = self.addresses[rank] if rank < len(self.addresses) else "unknown"
        log.error(
            "lost training rank %d (host %s): %s; exiting within --heartbeat-timeout-seconds %g",
            rank,
            host,
            why,
            self.timings.timeout_s,
        )
        if self.stacks is not None:
            path = self.stacks.dump(f"heartbeat: lost training rank {rank} (host {host}): {why}")
            if path is not None:
                log.error("every thread's stack of rank %d: %s", self.rank, path)
        budget = self.timings.exit_s
        runner = threading.Thread(target=self._run_cleanups, name="heartbeat-cleanup", daemon=True)
        runner.start()
        runner.join(timeout=max(0.0, budget - (time.monotonic() - began)))
        # the beat thread publishes the verdict at its next exchange: leave the peers two intervals to read it
        self._stop.wait(max(0.0, min(budget, 2 * self.timings.interval_s) - (time.monotonic() - began)))
        for handler in logging.getLogger("megatron_pacs").handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def _run_cleanups(self) -> None:
        for fn in self._cleanups:
            try:
                fn()
            except Exception:
                log.exception("heartbeat: a cleanup before the exit failed; going on")

    def close(self) -> None:
        """This rank leaves the run: its last beat says so (bounded), and the threads stop. A loss already being
        handled is not stopped (the process ends anyway)."""
        with self._lock:
            if self._fired:
                return
            self._leaving = True
            self._outbox.append((self._key(self.rank), DONE))
        self._wake.set()
        # bounded: a store that is gone leaves the beat thread stuck in a call (a daemon thread, it ends with us)
        self._left.wait(timeout=self.timings.interval_s + 1.0)
        self._stop.set()
        if self.stacks is not None:
            self.stacks.disarm_late_dump()
        self._watch_thread.join(timeout=1.0)
