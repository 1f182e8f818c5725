"""The work the fleet gives its engines: generation in balanced chunks, weight updates over three transports, the
sync probe, sleep and wake-up (the module docstring of :mod:`megatron_pacs.rollout.fleet`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import ray
import torch
from ray.exceptions import GetTimeoutError
from tqdm.auto import tqdm

from megatron_pacs.rollout.fleet.engines import ENGINE_DEAD, ENGINE_LOST, EngineSet, log
from megatron_pacs.rollout.lost import RolloutClusterLost
from megatron_pacs.rollout.placement import balance_chunks
from megatron_pacs.rollout.sync import (
    SideGroup,
    broadcast_buffer,
    close_group,
    ipc_handle,
    iter_buckets,
    pack_bucket,
    standalone_group,
)
from megatron_pacs.rollout.types import FleetEngine, Prompt, RolloutGroup, SamplingConfig

__all__ = ["RolloutFleet"]

T = TypeVar("T")


class RolloutFleet(EngineSet):
    """A fleet of engine actors behind one :class:`~megatron_pacs.rollout.types.RolloutEngine` (see the
    package docstring)."""

    # -- generation -------------------------------------------------------------------------------------------

    def _reconnecting(self, call: Callable[[], T]) -> T:
        """``call()``; when the rollout cluster's head is lost on the way, wait for it, start the fleet anew and
        call again (``--rollout-cluster-reconnect-seconds``; per-request seeds: a generation repeats exactly).

        Raises:
            RolloutClusterLost: The head did not come back in time (now, or at an earlier call).
        """
        while True:
            if self._lost is not None:
                raise RolloutClusterLost(self._lost)
            try:
                return call()
            except Exception as exc:
                if not self._may_reconnect(exc):
                    raise
                self._reconnect_until_done(exc)

    def _reconnect_until_done(self, cause: BaseException) -> None:
        """:meth:`_reconnect`, again when the head is lost once more while the fleet starts on it."""
        while True:
            try:
                return self._reconnect(cause)
            except RolloutClusterLost:
                raise
            except Exception as exc:
                if not self._may_reconnect(exc):
                    raise
                cause = exc

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for every prompt across the fleet.

        Returns:
            One group per prompt, in the prompts' order, whichever engine ran it (and whether or not an engine
            died or hung on the way, or the rollout cluster's head was lost and came back).

        Raises:
            RolloutClusterLost: The head was lost and did not come back within --rollout-cluster-reconnect-seconds.
        """
        return self._reconnecting(lambda: self._generate(prompts, sampling))

    def _generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[RolloutGroup]:
        if not prompts:
            return []
        self._call_restarts = 0
        timeout = self.config.engine_call_timeout_seconds
        expected = self._response_len if self._response_len is not None else sampling.max_tokens / 2
        costs = [(len(p) // 4 if isinstance(p, str) else len(p)) + sampling.n * expected for p in prompts]
        todo = deque(balance_chunks(costs, len(self.engines) * self.config.chunks_per_engine))
        results: list[RolloutGroup | None] = [None] * len(prompts)
        running: dict[Any, tuple[int, list[int], float]] = {}  # ref -> (engine, chunk, deadline)
        idle = deque(i for i in range(len(self.engines)) if i not in self._stale)
        if not idle:
            raise RuntimeError(self._NO_CURRENT_ENGINE)
        bar = tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not self.progress, leave=False)
        with bar:
            while todo or running:
                while todo and idle:
                    index, chunk = idle.popleft(), todo.popleft()
                    ref = self.engines[index].call.remote(
                        FleetEngine.generate.__name__, [prompts[i] for i in chunk], sampling, chunk
                    )
                    running[ref] = (index, chunk, time.monotonic() + timeout)
                self.num_in_flight = len(running)
                wait = max(0.0, min(d for _, _, d in running.values()) - time.monotonic())
                done, _ = ray.wait(list(running), num_returns=1, timeout=wait)
                if done:
                    ref = done[0]
                else:  # the oldest chunk is past its deadline: its engine is hung
                    ref = min(running, key=lambda r: running[r][2])
                index, chunk, _ = running.pop(ref)
                try:
                    if not done:
                        raise GetTimeoutError(f"a generation chunk of {len(chunk)} prompts took over {timeout:.0f} s")
                    groups = ray.get(ref)
                except ENGINE_LOST as exc:
                    todo.appendleft(chunk)  # its prompts run again, on the restarted engine or another one
                    self._restart(index, exc)
                    if index not in self._stale:
                        idle.append(index)
                    elif not idle and not running:
                        raise RuntimeError(self._NO_CURRENT_ENGINE) from exc
                    continue
                for i, g in zip(chunk, groups, strict=True):
                    results[i] = g
                idle.append(index)
                bar.update(len(chunk))
        self.num_in_flight = 0
        filled = cast(list[RolloutGroup], results)  # every chunk has come back: no None is left
        lengths = [len(r.token_ids) for g in filled for r in g.responses]
        mean = sum(lengths) / max(1, len(lengths))
        self._response_len = mean if self._response_len is None else 0.5 * (self._response_len + mean)
        return filled

    # -- weights ----------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Push HF-named weights into every engine, bucket by bucket, then reset their prefix caches.

        The stream is always consumed to its end, a failed update's too (on trainer rank 0 it drives the other
        ranks' gathers, which then stop with it instead of waiting in one). An engine lost on the way is restarted
        and given the whole update from the kept copy; without one (``--keep-weights-for-restart`` off) a broken
        side-group update fails the step. With
        ``--rollout-cluster-reconnect-seconds`` every update is also packed into a host copy; when the head is lost
        on the way, the rest of the stream goes into the copy and a fleet started anew on the head that came back
        gets the whole update from it (not back in time: the next generation raises :class:`RolloutClusterLost`).

        Returns:
            ``{"sync/seconds": ..., "sync/megabytes": ..., "sync/num_buckets": ...}``.
        """
        started = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.config.weight_sync_bucket_mb << 20)
        copy: list[tuple[torch.Tensor, list]] | None = [] if self._host_copy is not None else None
        stats = [0, 0]  # elements, buckets
        if self._lost is None:
            try:
                self._update(buckets, copy, stats)
            except Exception as exc:
                if not self._may_reconnect(exc):
                    for _ in buckets:  # the other ranks finish their gathers, so that they can stop with this one
                        pass
                    raise
                lost: BaseException | None = exc
            else:
                lost = None
        else:
            lost = RolloutClusterLost(self._lost)
        for bucket in buckets:  # the stream runs to its end (it drives the other ranks' gathers)
            stats[1] += 1
            if copy is not None and self._lost is None:  # what the lost cluster did not get
                copy.append(pack_bucket(bucket, device="cpu"))
                stats[0] += copy[-1][0].numel()
        if copy is not None and self._lost is None:
            self._host_copy, self._updated = copy, True
        if lost is not None and self._lost is None:
            try:
                self._reconnect_until_done(lost)  # the new engines get the whole update from the copy
            except RolloutClusterLost as exc:  # the next generation stops the run, on every rank alike
                log.warning("fleet: %s", exc)
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/megabytes": stats[0] / 2**20, "sync/num_buckets": float(stats[1])}

    def _update(self, buckets: Iterator[Any], copy: list[tuple[torch.Tensor, list]] | None, stats: list[int]) -> None:
        """The update proper (:meth:`update_weights`): each bucket packed, also into ``copy``, then sent."""
        self._call_restarts = 0
        self._restart_dead()
        self._call_all(FleetEngine.begin_weight_update.__name__)
        keep = self.keeps_weights
        latest, loads = [], []
        broken: BaseException | None = None  # the side-group transfer failed: the rest only goes into the copy
        for bucket in buckets:
            stats[1] += 1
            num = stats[1]
            if self.transport == "object_store":
                packed = pack_bucket(bucket, device="cpu")
                stats[0] += packed[0].numel()
                if copy is not None:
                    copy.append(packed)
                ref = ray.put(packed)
                del packed
                loads += [(i, e.load_bucket.remote(ref)) for i, e in enumerate(self.engines)]
                latest.append(ref)
                continue
            buffer, metas = pack_bucket(bucket)
            stats[0] += buffer.numel()
            host = (buffer.cpu(), metas) if keep or copy is not None else None
            if copy is not None and host is not None:
                copy.append(host)
            if keep:
                latest.append(ray.put(host))
            if broken is None:
                try:
                    self._send(buffer, metas)
                except Exception as exc:  # noqa: BLE001 - any failure of the side transfer: finish from the copy
                    broken = exc
                    log.warning("fleet: the weight update broke off at bucket %d: %s", num, exc)
        lost = self._lost_loads(loads)
        self._latest = latest if keep else []
        self._updated, self._stale = True, set()
        if broken is not None:
            if not keep:
                raise RuntimeError(
                    "fleet: an engine was lost during the weight update and no copy of it is kept to finish it "
                    "(--keep-weights-for-restart is off by default with GPU engines); add --keep-weights-for-restart, "
                    "or resume from the last checkpoint"
                ) from broken
            lost = {i: broken for i in range(len(self.engines))}  # the survivors hold part of the update
        for index, exc in lost.items():  # each is re-synced from the new copy, its finish included
            if isinstance(exc, ENGINE_DEAD) or not self._answers(index):
                self._restart(index, exc)
            else:
                self._replay(self.engines[index])
        self._call_all(
            FleetEngine.finish_weight_update.__name__,
            engines=[i for i in range(len(self.engines)) if i not in lost],
            repeat=False,
        )

    def _send(self, buffer: torch.Tensor, metas: list[Any]) -> None:
        """One packed bucket to every engine over the side channel (broadcast group or CUDA IPC)."""
        timeout = self.config.engine_call_timeout_seconds
        if self.transport == "broadcast":
            group = self._ensure_group()
            pending = [
                e.call.remote(FleetEngine.receive_broadcast.__name__, metas, buffer.numel()) for e in self.engines
            ]
            self._await_broadcast(broadcast_buffer(group, buffer, src=0, async_op=True), pending)
        else:  # ipc: the engines map the trainer's CUDA buffer; it must outlive their copy
            handle = ipc_handle(buffer)
            ray.get(
                [e.call.remote(FleetEngine.load_ipc.__name__, handle, metas) for e in self.engines], timeout=timeout
            )

    def _lost_loads(self, loads: list[tuple[int, Any]]) -> dict[int, BaseException]:
        """Wait for the object-store loads; the engines that died or hung on the way."""
        lost: dict[int, BaseException] = {}
        deadline = time.monotonic() + self.config.engine_call_timeout_seconds
        for index, ref in loads:
            if index in lost:
                continue
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ENGINE_LOST as exc:
                lost[index] = exc
        return lost

    def _answers(self, index: int) -> bool:
        try:
            ray.get(self.engines[index].ready.remote(), timeout=30)
            return True
        except ENGINE_LOST:
            return False

    def _await_broadcast(self, work: Any, pending: list[Any]) -> None:
        """Wait for a broadcast while watching the receivers: an engine that fails instead of joining would
        otherwise leave the trainer blocked until the collective's timeout."""
        deadline = time.monotonic() + self.config.engine_call_timeout_seconds
        while not work.is_completed():
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0.05)
            try:
                ray.get(ready)
                if time.monotonic() > deadline:
                    raise GetTimeoutError("a weight broadcast outlasted --engine-call-timeout-seconds")
            except Exception:
                close_group(self._group)  # a half-finished collective leaves the side group unusable
                self._group = None
                raise
        work.wait()
        ray.get(pending, timeout=max(0.0, deadline - time.monotonic()))

    def _sync_address(self) -> str:
        """Where the engines reach trainer rank 0 for the broadcast side group: ``--weight-sync-address``, else
        this host's source address towards the engines' nodes. (Through Ray Client, Ray's own node address of
        the driver is 127.0.0.1, which engines on other hosts cannot reach.)"""
        if self.config.weight_sync_address:
            return self.config.weight_sync_address
        from megatron_pacs.utils.launch import source_address

        nodes = ray.get([e.node_ip.remote() for e in self.engines], timeout=self.config.engine_call_timeout_seconds)
        host = source_address(nodes)
        log.info("fleet: weight sync rendezvous at %s (engines on %s)", host, ", ".join(sorted(set(nodes))))
        return host

    def _ensure_group(self) -> SideGroup:
        if self._group is not None:
            return self._group
        from megatron_pacs.utils.launch import free_port

        host, port = self._sync_address(), free_port()
        world = 1 + len(self.engines) * self.config.rollout_tensor_parallel_size
        backend = "nccl" if self.on_gpu else "gloo"
        pending = [
            e.call.remote(
                FleetEngine.init_broadcast_group.__name__,
                backend,
                host,
                port,
                1 + i * self.config.rollout_tensor_parallel_size,
                world,
            )
            for i, e in enumerate(self.engines)
        ]
        self._group = standalone_group(backend, host, port, 0, world)
        ray.get(pending, timeout=self.config.engine_call_timeout_seconds)
        return self._group

    def verify_sync(
        self, probe_token_ids: Sequence[Sequence[int]], reference_logprobs: Sequence[Sequence[float]]
    ) -> float:
        """Largest |engine - trainer| token log-prob over the probes, across the engines holding the latest weights.

        Args:
            probe_token_ids: Full sequences (prompt + response) of token ids.
            reference_logprobs: The trainer's ``log p(ids[t + 1] | ids[:t + 1])`` per sequence (length L_i - 1).
        """
        if self._lost is not None:  # the run stops at the next generation
            return float("nan")
        try:
            return self._reconnecting(lambda: self._verify_sync(probe_token_ids, reference_logprobs))
        except RolloutClusterLost:
            return float("nan")

    def _verify_sync(
        self, probe_token_ids: Sequence[Sequence[int]], reference_logprobs: Sequence[Sequence[float]]
    ) -> float:
        self._call_restarts = 0
        worst = 0.0
        current = [i for i in range(len(self.engines)) if i not in self._stale]
        for per_engine in self._call_all(FleetEngine.prompt_logprobs.__name__, probe_token_ids, engines=current):
            for got, ref in zip(per_engine or [], reference_logprobs, strict=False):
                if len(got) != len(ref):
                    raise ValueError(f"reference_logprobs has {len(ref)} entries where the probe needs {len(got)}")
                worst = max([worst] + [abs(a - b) for a, b in zip(got, ref, strict=True)])
        return worst

    # -- lifecycle --------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        self._call_restarts = 0
        self._call_all(FleetEngine.sleep.__name__, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_restarts = 0
        self._call_all(FleetEngine.wake_up.__name__, tags)
