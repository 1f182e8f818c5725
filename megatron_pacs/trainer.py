"""The training loop behind ``megatron_pacs.train``: set-up, the step, validation, weight sync, logging.

Rank 0 is the driver: it owns the fleet, the reward pool, the metric sinks and the rollout dumps; every rank owns
its model shard. Collectives in this file run on the default (world) group, which every rank joins in the same
order: the rollout distribution (each data-parallel rank receives its share as tensors), the metric gather inside
``update_policy``, and the weight export (TP gathers and PP broadcasts inside the exporter). With
``--off-policy-steps 1`` the driver generates the next step's rollouts in a background thread during the update
(:mod:`megatron_pacs.producer`), and with ``--max-staleness`` a stream runs across steps
(:mod:`megatron_pacs.streaming`); with ``--colocate`` the engines sleep around it
(:mod:`megatron_pacs.rollout.colocate`). How a run stops and what it keeps: :mod:`megatron_pacs.stops`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm

from megatron_pacs.algo.objectives import build_objective
from megatron_pacs.checkpointing import RunCheckpoints
from megatron_pacs.config import TrainConfig
from megatron_pacs.config.sources import open_source, source_spec
from megatron_pacs.consistency import check_logprob_bound, probe_due, probe_sync
from megatron_pacs.critic_update import update_critic
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.distribute import distribute_rollouts
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.critic import Critic
from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.producer import Generated, RolloutProducer
from megatron_pacs.rollout.colocate import Colocation, TrainingStates
from megatron_pacs.sources.base import RolloutSource
from megatron_pacs.sources.dumps import DumpContext, dump_rollouts, tokenizer_fingerprint
from megatron_pacs.sources.filtering import GroupFilter
from megatron_pacs.stops import RunStops
from megatron_pacs.streaming import StreamProducer
from megatron_pacs.update import update_policy
from megatron_pacs.utils.checkpoint_dirs import CheckpointWriteError
from megatron_pacs.utils.exit_signal import ExitSignal
from megatron_pacs.utils.heartbeat import Heartbeat
from megatron_pacs.utils.interrupts import interrupt_received, raise_if_swallowed, waiting_for
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.progress import progress_bar
from megatron_pacs.utils.seeding import use_deterministic_kernels
from megatron_pacs.utils.sinks import MetricsWriter
from megatron_pacs.utils.stacks import StackDumps
from megatron_pacs.utils.timing import PhaseTimer
from megatron_pacs.validation import validate, validation_due

if TYPE_CHECKING:
    from megatron_pacs.rewards.scorer import RewardScorer
    from megatron_pacs.rollout.fleet import RolloutFleet

__all__ = ["Trainer"]

log = get_logger("trainer")

CLOSE_WAIT_S = 30.0
"""How long :meth:`Trainer.close` waits for a generation in flight before stopping the fleet under it, and, after
Ctrl-C or SIGTERM, for a checkpoint's writer (``--async-save``) before abandoning its save."""


class Trainer(RunStops):
    """Builds the actor, the fleet and the sinks; :meth:`fit` runs the steps. Use as a context manager."""

    def __init__(self, cfg: TrainConfig, val_rows: dict[str, list[PromptRow]] | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.cfg, self.val_rows = cfg, val_rows or {}
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_model)
        self.dump_context = DumpContext(
            tokenizer_size=len(self.tokenizer),
            tokenizer_sha256=tokenizer_fingerprint(self.tokenizer),
            vocab_size=int(AutoConfig.from_pretrained(cfg.model.hf_model).vocab_size),
            temperature=cfg.rollout.temperature,
        )
        self.log_dir = Path(cfg.run.log_dir)
        self.source_spec = source_spec(cfg.source.rollout_source)
        self.source: RolloutSource | None = None
        if self.source_spec.checked_everywhere:  # its input is refused on every rank before anything is built
            self.source = self._open_source()
            self.source.check(range(1, cfg.run.train_iters + 1) if cfg.checkpoint.load is None else [])
        # SIGUSR1 dumps every thread's stack from here on: a rendezvous that hangs can be looked at too
        self.stacks = StackDumps(Path(cfg.run.log_dir) / "stacks", rank=int(os.environ.get("RANK", "0")))
        self.stacks.install()
        self.writer: MetricsWriter | None = None
        self.samples: list[dict] = []  # the driver's --log-samples records of the step being logged
        if cfg.model.deterministic_mode:  # before the first CUDA kernel and NCCL's communicator
            log.info("--deterministic-mode: deterministic kernels only (%s)", use_deterministic_kernels() or "env set")
        self.groups = init_parallel(cfg.parallel, seed=cfg.run.seed)
        self.rank = dist.get_rank()
        # from here on a rank that stops beating ends every other rank within --heartbeat-timeout-seconds
        self.heartbeat = Heartbeat.from_environment(
            cfg.run.heartbeat_timeout_seconds, self.groups.rank_addresses, self.stacks
        )
        if self.heartbeat is not None:
            self.heartbeat.add_cleanup(self._before_lost_exit)
        self.driver = self.rank == 0
        torch.manual_seed(cfg.run.seed)
        self.actor = Actor(cfg.model, self.groups, cfg.optim)
        self.reference: ReferencePolicy | None = None
        if cfg.needs_reference:
            ref = cfg.reference
            self.reference = ReferencePolicy(cfg.model, self.groups, load=ref.ref_load, offload=ref.ref_offload)
        self.critic: Critic | None = None
        if cfg.loss.loss == "ppo":  # PPO's value model, on the actor's layout
            self.critic = Critic(cfg.model, cfg.critic, self.groups, cfg.optim)
        self.objective = build_objective(cfg.loss, cfg.batch)
        for warning in cfg.warnings() if self.rank == 0 else ():
            log.warning(warning)
        self.timer = PhaseTimer(cuda_sync=torch.cuda.is_available())
        self.fleet: RolloutFleet | None = None
        self.scorer: RewardScorer | None = None
        self.engine_version = 0  # the training step whose weights the engines hold
        self.pending_step: int | None = None  # a step whose rollouts are generated ahead (every rank knows)
        # the last step whose update the weights hold, with the data position right after its prompts; the last saved
        self.updated: tuple[int, dict] = (0, {})
        self.unsynced: tuple[int, dict[str, float]] = (0, {})  # the last update's metrics, until its sync is done
        self.saved_step = 0
        # Colocated, the training state leaves the GPU before the engines start (vLLM's start-up check wants
        # --gpu-memory-utilization of the GPU free); the engines own that memory until the first update.
        self.colocation = self._colocation()
        if self.colocation is not None:
            self.colocation.start()
        self.producer = self._start_source()
        if self.colocation is not None:
            self.colocation.engine = self.fleet
        self.exit_signal: ExitSignal | None = None
        if cfg.run.exit_signal_handler:  # after the fleet: ray.init installs a SIGTERM handler that this replaces
            self.exit_signal = ExitSignal(cfg.run.exit_signal_grace_seconds)
        self.checkpoints = RunCheckpoints(cfg, self.actor, self.reference, driver=self.driver, critic=self.critic)

    def _colocation(self) -> Colocation | None:
        """The colocated cycle (``--colocate``); its engine is attached once the driver has started the fleet."""
        r = self.cfg.rollout
        if not r.colocate:
            return None
        if not r.offload_optimizer_during_rollout:
            return Colocation(None, None)
        return Colocation(None, self.actor if self.critic is None else TrainingStates(self.actor, self.critic))

    def _open_source(self) -> RolloutSource:
        return open_source(self.cfg, tokenizer=self.tokenizer, log_dir=str(self.log_dir), context=self.dump_context)

    def _start_source(self) -> RolloutProducer | StreamProducer:
        """The producer that runs the rollout source now or, one step off, in the background, or the asynchronous
        stream (``--max-staleness``); the source (opened here unless already open) and its engines and reward pool
        on the driver only."""
        if not self.driver:
            return RolloutProducer(None)
        if self.source is None:
            self.source = self._open_source()
        self.fleet, self.scorer = self.source.fleet, self.source.scorer
        if self.cfg.rollout.max_staleness is not None:
            fleet, scorer = self.source.fleet, self.source.scorer
            return StreamProducer(self.cfg, self.tokenizer, fleet.generate, scorer.score, guard=self._rollout_side)
        return RolloutProducer(
            self.source.collect,
            guard=self._rollout_side,
            engines=self.source_spec.engines,
            group_filter=GroupFilter.from_config(self.cfg),
        )

    # -- the loop ----------------------------------------------------------------------------------------------

    def fit(self, loader: PromptLoader) -> list[dict[str, float]]:
        """Resume if ``--load`` holds a checkpoint, then run the remaining steps up to ``--train-iters``.

        Returns:
            Every step's metrics of this run (on every rank).
        """
        cfg = self.cfg
        start_step = self._resume_and_sync(loader) if cfg.checkpoint.load else 0
        self.producer.start(loader)
        if self.source is not None and cfg.checkpoint.load:  # the steps left after the resume (every rank alike)
            self.source.check(range(start_step + 1, cfg.run.train_iters + 1))
        self.writer = self._metrics_writer(start_step)
        if start_step == 0 and validation_due(cfg.eval, 0, cfg.run.train_iters):
            self.writer.log(0, self.validate())
        history = []
        bar = progress_bar(start_step, cfg.run.train_iters, enabled=self.driver)
        # Log lines (one per step) go through tqdm.write, so the bar stays one line below them.
        with logging_redirect_tqdm(loggers=[logging.getLogger("megatron_pacs")]):
            self.updated, self.saved_step = (start_step, loader.state_dict()), start_step
            for step in (s + 1 for s in bar):
                raise_if_swallowed()
                metrics = self._step_unless_lost(loader, step)
                if metrics is None:
                    break
                if validation_due(cfg.eval, step, cfg.run.train_iters):
                    metrics.update(self.validate())
                if self._log_or_stop(step, metrics, loader):
                    break
                history.append(metrics)
                if self._save_or_stop(step, loader):
                    break
                if self.driver:
                    bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', float('nan')):.3f}")
        bar.close()
        return history

    def _metrics_writer(self, start_step: int) -> MetricsWriter:
        cfg = self.cfg
        return MetricsWriter(
            self.log_dir,
            enabled=self.driver,
            wandb_project=cfg.run.wandb_project,
            wandb_name=cfg.run.wandb_exp_name,
            config=cfg.to_dict(),
            total_steps=cfg.run.train_iters,
            # the first step this run logs: the rows of the steps the checkpoint holds stay, later ones go
            start_step=start_step + 1 if start_step else 0,
            fresh=start_step == 0,
        )

    def step(self, loader: PromptLoader, step: int) -> dict[str, float]:
        """One training step (collective): this step's rollouts (generated now, or during the previous step with
        ``--off-policy-steps 1``), the next step's generation started in the background, the update, a reference
        reset when due, then the weight sync once no generation is in flight."""
        started = time.perf_counter()
        # generated during the previous step (or restored), or taken from the asynchronous stream: older weights
        ahead = self.pending_step == step or self.cfg.rollout.max_staleness is not None
        rows = None if ahead else loader.next_batch()
        self.pending_step = None
        gen = self.producer.rollouts(rows, step, self.engine_version, refill=loader.next_batch)
        position = loader.state_dict()  # after this step's prompts and refills: a checkpoint of this step resumes here
        self._dump(step, gen)
        if self.cfg.rollout.off_policy_steps and step < self.cfg.run.train_iters:
            self.pending_step = step + 1
            self.producer.ahead(loader.next_batch(), step + 1, self.engine_version, refill=loader.next_batch)
        batch = self._distribute(gen)
        metrics, train = self._update(batch, step, same_weights=not ahead)
        self.updated = (step, position)  # the weights now hold this step (its sync to the engines may still fail)
        self.unsynced = (step, {**metrics, **(gen.rollouts.metrics if gen is not None else {})})
        self.producer.drain()
        # warming up the critic, the actor's weights have not moved: the engines keep theirs, except colocated ones,
        # which dropped them for the update (level-2 sleep) and take the same weights back
        if not self._critic_warmup(step) or self.colocation is not None:
            metrics.update(self._sync(step, batch))
        self.unsynced = (0, {})  # synced: the step's row is logged with the rest
        metrics.update(self.timer.collect())
        if gen is not None:
            metrics.update(self._driver_metrics(step, gen, loader, train, (started, time.perf_counter())))
        return metrics

    def _update(self, batch: RolloutBatch, step: int, *, same_weights: bool) -> tuple[dict, tuple[float, float]]:
        """The update on this rank's share (collective), the consistency bound, the reference's reset when due;
        the metrics and the update's ``(start, end)``."""
        cfg = self.cfg
        if self.colocation is not None:
            self.colocation.before_train()
        started = time.perf_counter()
        advantages, metrics = None, {}
        if self.critic is not None:
            advantages, metrics = update_critic(
                self.critic,
                batch,
                cfg.batch,
                cfg.critic,
                self.groups,
                self.timer,
                actor=self.actor,
                temperature=cfg.rollout.temperature,
                reference=self.reference,
            )
        if self._critic_warmup(step):  # steps 1..N of --critic-warmup N train the critic only
            return metrics, (started, time.perf_counter())
        metrics |= update_policy(
            self.actor,
            batch,
            self.objective,
            cfg.batch,
            self.groups,
            self.timer,
            temperature=cfg.rollout.temperature,
            reference=self.reference,
            tis_mode=cfg.loss.tis_mode,
            tis_low=cfg.loss.tis_low,
            tis_high=cfg.loss.tis_high,
            same_weights=same_weights,
            score_fp8=cfg.score_fp8,
            advantages=advantages,
        )
        train = (started, time.perf_counter())
        check_logprob_bound(cfg.rollout.max_logprob_diff, metrics, step)
        if self.reference is not None:
            metrics.update(self._after_step_reference(step, metrics))
        return metrics, train

    def _critic_warmup(self, step: int) -> bool:
        """Step ``step`` is one of ``--critic-warmup N``'s first N: the critic trains, the actor does not."""
        return self.critic is not None and step <= self.cfg.critic.critic_warmup

    def _sync(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """The weights into the engines (collective; colocated, the engines wake around it), then the sync probe
        when due (:func:`~megatron_pacs.consistency.probe_due`)."""
        with self.timer.phase("sync"), self._rollout_side():
            sync = self.colocation.after_train(self.sync_weights) if self.colocation else self.sync_weights()
        self.engine_version = step
        if self.source_spec.engines and probe_due(self.cfg, step):
            with self._rollout_side():
                sync["sync/max_logprob_diff"] = probe_sync(self.actor, self.fleet, batch)
            check_logprob_bound(self.cfg.rollout.max_logprob_diff, sync, step)
        return sync

    def _driver_metrics(
        self,
        step: int,
        gen: Generated,
        loader: PromptLoader,
        train: tuple[float, float],
        window: tuple[float, float],
    ) -> dict[str, float]:
        """The driver's share of the step's metrics (rollouts, faults, timing, throughput)."""
        elapsed = window[1] - window[0]
        metrics = dict(gen.rollouts.metrics)
        if self.fleet is not None:  # read now: a loss during this step's sync or probe counts in this step
            metrics.update(self.fleet.fault_counts())
        metrics.update(self.producer.step_metrics(gen, train, window))
        metrics["data/dropped_prompts"] = float(loader.dropped)  # over --max-prompt-length, at load
        metrics["perf/time/step"] = elapsed
        metrics["perf/tokens_per_sec"] = gen.rollouts.metrics.get("rollout/num_tokens", 0.0) / elapsed
        self.samples = gen.rollouts.records[: self.cfg.run.log_samples]  # logged with the metrics (_log_or_stop)
        return metrics

    def _dump(self, step: int, gen: Generated | None) -> None:
        """The step's rollouts into ``--log-dir/rollouts/`` (the driver), before its update: a full disk stops the
        run with the weights of the step before (:meth:`_step_unless_lost` saves them)."""
        if gen is not None:
            dump_rollouts(self.cfg.run, step, gen.rollouts, self.dump_context)

    def _distribute(self, gen: Generated | None) -> RolloutBatch:
        """Every rank's data-parallel share of the driver's rollouts (collective; tensors, not pickles)."""
        if dist.get_world_size() == 1:
            assert gen is not None
            return gen.rollouts.batch
        with self.timer.phase("distribute"):
            full = gen.rollouts.batch if gen is not None else None
            return distribute_rollouts(full, self.cfg.batch, self.groups)

    def _after_step_reference(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The reference's reset when due (:meth:`ReferencePolicy.after_step`) and its metrics."""
        assert self.reference is not None
        cfg = self.cfg
        never = not cfg.reference.ref_reset_interval and cfg.loss.pacs_score_reference == "ref"
        if self.driver and never and "pacs/score/max" in metrics:
            # never reset: the score's range is the drift since the start (cfg.warnings)
            log.info("step %d: pacs/score in [%.3g, %.3g]", step, metrics["pacs/score/min"], metrics["pacs/score/max"])
        return self.reference.after_step(step, self.actor, self.cfg.reference)

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights into every engine (all ranks take part in the export). Without a fleet the
        export still runs, with its TP/PP gathers, so ``perf/time/sync`` measures the trainer's side of a sync."""
        weights = self.actor.export_hf_weights()
        if self.driver and self.fleet is not None:
            return self.fleet.update_weights(weights)
        for _ in weights:  # the other ranks' part of the gathers; without a fleet, the export alone (timed)
            pass
        return {}

    def validate(self) -> dict[str, float]:
        """Mean reward per validation source (driver only; the others return {})."""
        if not self.driver or not self.val_rows:
            return {}
        return validate(self.fleet, self.scorer, self.tokenizer, self.val_rows, self.cfg)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save(self, step: int, loader: PromptLoader, *, background: bool = False, position: dict | None = None) -> Path:
        """This run's checkpoint after ``step`` (collective; :class:`~megatron_pacs.checkpointing.RunCheckpoints`);
        with ``background`` and ``--async-save``, its shards are still being written on return. ``position``: the
        loader's (default: where it stands)."""
        # One step off: the next step's rollouts are done (the sync waited for them); they are kept with it.
        # Asynchronous: the stream and the loader's position that go with this step's update (the stream runs on).
        pending = self.producer.done if self.pending_step else None
        if isinstance(self.producer, StreamProducer):
            pending = self.producer.kept(step)
            position = pending["loader"] if pending is not None else position
        with self.timer.phase("save_wait"):  # --async-save: the save still in flight first (at most one)
            self.checkpoints.wait()
        with self.timer.phase("save"):
            path = self.checkpoints.save(
                step,
                loader,
                pending_step=self.pending_step,
                pending_rollouts=pending,
                background=background,
                position=position,
                stream=self.cfg.rollout.max_staleness is not None,
            )
        if self.driver and self.checkpoints.in_flight is None:
            log.info("saved step %d to %s", step, path)
        return path

    def _resume_and_sync(self, loader: PromptLoader) -> int:
        """:meth:`resume`, then the loaded weights into the fleet. Colocated, the load is one colocated cycle: the
        engines sleep and the training state comes back to the GPU for the checkpoint to load into, then the
        trainer frees it and the engines wake with the loaded weights."""
        if self.colocation is None:
            step = self.resume(loader)
            if step:
                self.sync_weights()
            return step
        self.colocation.before_train()
        step = self.resume(loader)
        self.colocation.after_train(self.sync_weights)  # also at step 0: level-2 sleep dropped the weights
        return step

    def resume(self, loader: PromptLoader) -> int:
        """Load the newest complete checkpoint under ``--load``; returns its step (0 when there is none yet: a fresh
        start from ``--hf-model``). The caller pushes the weights to the fleet."""
        resumed = self.checkpoints.resume(loader)
        if resumed.step:
            self.pending_step = resumed.pending_step
            if isinstance(self.producer, StreamProducer):
                self.producer.restore(resumed.pending_rollouts, resumed.step)
            elif self.driver and resumed.pending_rollouts is not None:
                self.producer.done = resumed.pending_rollouts
            self.engine_version = resumed.step
        return resumed.step

    # -- teardown ----------------------------------------------------------------------------------------------

    def _before_lost_exit(self) -> None:
        """Before a lost rank ends the process (heartbeat thread, bounded): the engines killed at once (the driver),
        the metrics logged so far to disk (JSONL lines already are)."""
        if self.fleet is not None:
            self.fleet.abandon()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        # --async-save: a save still in flight (after a failure elsewhere, or a stop signal) is waited for and
        # committed, within a bound: CLOSE_WAIT_S after Ctrl-C or SIGTERM (the watchdog ends the process
        # SIGTERM_GRACE_S after the signal), else the collectives' own timeout
        stopping = interrupt_received()
        bound = CLOSE_WAIT_S if stopping else self.cfg.parallel.distributed_timeout_minutes * 60.0
        try:
            self.checkpoints.wait(timeout=bound)
        except CheckpointWriteError as exc:  # its message is the whole story: one line
            log.error("close: %s", exc)
        except Exception:
            log.exception("close: the checkpoint in flight could not be completed")
        if self.exit_signal is not None:
            self.exit_signal.finish()
        # This rank leaves: its last beat says so, so the others (still shutting down) do not take it for lost.
        if self.heartbeat is not None:
            self.heartbeat.close()
        # Bounded and exhaustive: a generation stuck in flight is waited for CLOSE_WAIT_S at most (stopping the
        # fleet then ends it), and a step that fails is logged without skipping the ones after it.
        producer, writer, fleet, source = self.producer, self.writer, self.fleet, self.source
        steps: list[tuple[str, Callable[[], object]]] = []
        if producer is not None:
            steps.append(("wait for the generation in flight", lambda: producer.close(timeout=CLOSE_WAIT_S)))
        if writer is not None:
            steps.append(("close the metric sinks", writer.close))
        if fleet is not None:
            steps.append(("shut the fleet down", fleet.shutdown))
        if producer is not None:
            steps.append(("stop the generation thread", lambda: producer.close(timeout=0.0)))
        if source is not None:
            steps.append(("close the rollout source", source.close))
        steps.append(("destroy the process groups", destroy_parallel))
        steps.append(("restore SIGUSR1", self.stacks.close))
        for what, step in steps:
            try:
                with waiting_for(f"the shutdown's step: {what}"):  # the watchdog's line names it
                    step()
            except Exception:
                log.exception("close: could not %s; going on with the rest of the shutdown", what)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
