"""The training loop behind ``megatron_pacs.train``: set-up, the step, validation, weight sync, logging.

Rank 0 is the driver: it owns the fleet, the reward pool, the metric sinks and the rollout dumps; every rank owns
its model shard. Collectives in this file run on the default (world) group, which every rank joins in the same
order: the rollout distribution (each data-parallel rank receives its share as tensors), the metric gather inside
``update_policy``, and the weight export (TP gathers and PP broadcasts inside the exporter). With
``--off-policy-steps 1`` the driver generates the next step's rollouts in a background thread during the update
(:mod:`megatron_pacs.producer`); with ``--colocate`` the engines sleep around it
(:mod:`megatron_pacs.rollout.colocate`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from megatron_pacs.algo.objectives import build_objective
from megatron_pacs.checkpointing import RunCheckpoints
from megatron_pacs.config import TrainConfig
from megatron_pacs.consistency import check_logprob_bound, probe_sync
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.distribute import distribute_rollouts, send_stop
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.producer import Generated, RolloutProducer, overlap_metrics
from megatron_pacs.update import update_policy
from megatron_pacs.rollout.colocate import Colocation
from megatron_pacs.rollout.lost import RolloutClusterLost, stopped_with_the_job
from megatron_pacs.sources import (
    DumpContext,
    FleetSource,
    ReplaySource,
    RolloutSource,
    build_source,
    dump_rollouts,
    tokenizer_fingerprint,
)
from megatron_pacs.utils.exit_signal import ExitSignal
from megatron_pacs.utils.heartbeat import Heartbeat
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.seeding import use_deterministic_kernels
from megatron_pacs.utils.sinks import MetricsWriter
from megatron_pacs.utils.stacks import StackDumps
from megatron_pacs.utils.timing import PhaseTimer
from megatron_pacs.validation import validate

if TYPE_CHECKING:
    from megatron_pacs.rewards.scorer import RewardScorer
    from megatron_pacs.rollout.fleet import RolloutFleet

__all__ = ["Trainer"]

log = get_logger("trainer")

CLOSE_WAIT_S = 30.0
"""How long :meth:`Trainer.close` waits for a generation in flight before stopping the fleet under it."""


class Trainer:
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
        self.replay: ReplaySource | None = None
        if cfg.source.rollout_source == "replay":  # refused on every rank before anything is built
            self.replay = ReplaySource(cfg, self.dump_context)
            self.replay.check(range(1, cfg.run.train_iters + 1) if cfg.checkpoint.load is None else [])
        # SIGUSR1 dumps every thread's stack from here on: a rendezvous that hangs can be looked at too
        self.stacks = StackDumps(Path(cfg.run.log_dir) / "stacks", rank=int(os.environ.get("RANK", "0")))
        self.stacks.install()
        self.writer: MetricsWriter | None = None
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
        if cfg.loss.needs_reference:
            ref = cfg.reference
            self.reference = ReferencePolicy(cfg.model, self.groups, load=ref.ref_load, offload=ref.ref_offload)
        self.objective = build_objective(cfg.loss, cfg.batch)
        for warning in cfg.warnings() if self.rank == 0 else ():
            log.warning(warning)
        self.log_dir = Path(cfg.run.log_dir)
        self.timer = PhaseTimer(cuda_sync=torch.cuda.is_available())
        self.source: RolloutSource | None = None
        self.fleet: RolloutFleet | None = None
        self.scorer: RewardScorer | None = None
        self.producer: RolloutProducer | None = None
        self.engine_version = 0  # the training step whose weights the engines hold
        self.pending_step: int | None = None  # a step whose rollouts are generated ahead (every rank knows)
        # the last step whose update the weights hold, with the data position right after its prompts; the last saved
        self.updated: tuple[int, dict] = (0, {})
        self.saved_step = 0
        # Colocated, the training state leaves the GPU before the engines start (vLLM's start-up check wants
        # --gpu-memory-utilization of the GPU free); the engines own that memory until the first update.
        self.colocation = self._colocation()
        if self.colocation is not None:
            self.colocation.start()
        if self.driver:
            self._start_source()
        if self.colocation is not None:
            self.colocation.engine = self.fleet
        self.exit_signal: ExitSignal | None = None
        if cfg.run.exit_signal_handler:  # after the fleet: ray.init installs a SIGTERM handler that this replaces
            self.exit_signal = ExitSignal(cfg.run.exit_signal_grace_seconds)
        self.checkpoints = RunCheckpoints(cfg, self.actor, self.reference, driver=self.driver)

    def _colocation(self) -> Colocation | None:
        """The colocated cycle (``--colocate``); its engine is attached once the driver has started the fleet."""
        r = self.cfg.rollout
        if not r.colocate:
            return None
        return Colocation(None, self.actor if r.offload_optimizer_during_rollout else None)

    def _start_source(self) -> None:
        """Driver: the rollout source, and the producer that runs it now or, one step off, in the background."""
        self.source = build_source(self.cfg, self.tokenizer, str(self.log_dir), self.dump_context, self.replay)
        if isinstance(self.source, FleetSource):
            self.fleet, self.scorer = self.source.fleet, self.source.scorer
        self.producer = RolloutProducer(self.source.collect)

    # -- the loop ----------------------------------------------------------------------------------------------

    def fit(self, loader: PromptLoader) -> list[dict[str, float]]:
        """Resume if ``--load`` holds a checkpoint, then run the remaining steps up to ``--train-iters``.

        Returns:
            Every step's metrics of this run (on every rank).
        """
        cfg = self.cfg
        start_step = self._resume_and_sync(loader) if cfg.checkpoint.load else 0
        if self.replay is not None and cfg.checkpoint.load:  # the steps left after the resume (every rank alike)
            self.replay.check(range(start_step + 1, cfg.run.train_iters + 1))
        self.writer = MetricsWriter(
            self.log_dir,
            enabled=self.driver,
            wandb_project=cfg.run.wandb_project,
            wandb_name=cfg.run.wandb_exp_name,
            config=cfg.to_dict(),
            total_steps=cfg.run.train_iters,
            # the first step this run logs: the rows of the steps the checkpoint holds stay, later ones go
            start_step=start_step + 1 if start_step else 0,
        )
        history = []
        every = cfg.eval.eval_interval
        if every and start_step == 0:
            self.writer.log(0, self.validate())
        bar = tqdm(
            range(start_step, cfg.run.train_iters),
            desc="train",
            unit="step",
            disable=not self.driver,
            initial=start_step,
            total=cfg.run.train_iters,
        )
        # Log lines (one per step) go through tqdm.write, so the bar stays one line below them.
        with logging_redirect_tqdm(loggers=[logging.getLogger("megatron_pacs")]):
            self.updated, self.saved_step = (start_step, loader.state_dict()), start_step
            for step in (s + 1 for s in bar):
                try:
                    metrics = self.step(loader, step)
                except RolloutClusterLost:  # not back within --rollout-cluster-reconnect-seconds (§6.3)
                    send_stop()  # the driver: in place of the rollouts the others wait for
                    done = self._save_last_update(loader)
                    if self.exit_signal is None or self.exit_signal.received_at is None:
                        raise
                    # a scheduler stopping the job signals every step of it, the rollout cluster's too (hetjob)
                    log.warning("exit signal: the rollout side failed after it; stopped after step %d; exiting 0", done)
                    break
                if every and (step % every == 0 or step == cfg.run.train_iters):
                    metrics.update(self.validate())
                self.writer.log(step, metrics)
                history.append(metrics)
                last = step == cfg.run.train_iters
                ck = cfg.checkpoint
                saved = ck.save and ((ck.save_interval and step % ck.save_interval == 0) or last)
                if saved:
                    self.save(step, loader)
                    self.saved_step = step
                if self.exit_signal is not None and not last and self.exit_signal.should_stop():
                    log.warning("exit signal: every rank stops after step %d", step)
                    if ck.save and not saved:
                        self.save(step, loader)
                    log.warning("exit signal: stopped after step %d (checkpoint: %s); exiting 0", step, ck.save)
                    break
                if self.driver:
                    bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', float('nan')):.3f}")
        bar.close()
        return history

    def _save_last_update(self, loader: PromptLoader) -> int:
        """After the rollout side failed in the middle of a step: save the last step whose update the weights hold
        (this one when the failure came after its update, during the weight sync; else the one before), at the data
        position right after that step's own prompts (prompts drawn ahead for the next step go back). Returns it."""
        done, position = self.updated
        if self.cfg.checkpoint.save and done > self.saved_step:
            loader.load_state_dict(position)
            self.pending_step = None  # rollouts generated ahead are lost with the step; a resume generates them
            self.save(done, loader)
            self.saved_step = done
        return done

    def step(self, loader: PromptLoader, step: int) -> dict[str, float]:
        """One training step (collective): this step's rollouts (generated now, or during the previous step with
        ``--off-policy-steps 1``), the next step's generation started in the background, the update, a reference
        reset when due, then the weight sync once no generation is in flight."""
        cfg = self.cfg
        started = time.perf_counter()
        rows = None if self.pending_step == step else loader.next_batch()
        position = loader.state_dict()  # right after this step's prompts: a checkpoint of this step resumes here
        self.pending_step = None
        gen, ran, waited = None, [], 0.0  # this step's rollouts; generations run during it; trainer's wait
        if self.driver:
            assert self.producer is not None
            t0 = time.perf_counter()
            with self._rollout_side():
                if rows is None:
                    gen = self.producer.take(step)  # generated during the previous step (or restored)
                else:
                    gen = self.producer.run(rows, step, self.engine_version)
                    ran.append(gen)
            waited += time.perf_counter() - t0
        if cfg.rollout.off_policy_steps and step < cfg.run.train_iters:
            next_rows, self.pending_step = loader.next_batch(), step + 1
            if self.driver:
                assert self.producer is not None
                self.producer.submit(next_rows, step + 1, self.engine_version)
        batch = self._distribute(gen)
        if self.colocation is not None:
            self.colocation.before_train()
        train_started = time.perf_counter()
        metrics = update_policy(
            self.actor,
            batch,
            self.objective,
            cfg.batch,
            self.groups,
            self.timer,
            temperature=cfg.rollout.temperature,
            reference=self.reference,
            tis_cap=cfg.loss.tis_cap,
            same_weights=rows is not None,  # generated ahead (one step off, or restored): older weights
            score_fp8=cfg.score_fp8,
        )
        train = (train_started, time.perf_counter())
        check_logprob_bound(cfg.rollout.max_logprob_diff, metrics, step)
        if self.reference is not None:
            metrics.update(self._after_step_reference(step, metrics))
        self.updated = (step, position)  # the weights now hold this step (its sync to the engines may still fail)
        if self.driver and self.producer is not None and self.producer.in_flight:
            t0 = time.perf_counter()
            with self._rollout_side():
                ran.append(self.producer.wait())
            waited += time.perf_counter() - t0
        with self.timer.phase("sync"), self._rollout_side():
            sync = self.colocation.after_train(self.sync_weights) if self.colocation else self.sync_weights()
        self.engine_version = step
        # with --max-logprob-diff every sync is probed and compared (the consistency check above sees only steps
        # whose rollouts came from the current weights: not those generated one step off or before a resume)
        bound = cfg.rollout.max_logprob_diff
        probe = bound is not None or step == 1 or (cfg.eval.eval_interval and step % cfg.eval.eval_interval == 0)
        if probe and cfg.source.rollout_source == "fleet":
            with self._rollout_side():
                sync["sync/max_logprob_diff"] = probe_sync(self.actor, self.fleet, batch)
            check_logprob_bound(bound, sync, step)
        metrics.update(sync)
        metrics.update(self.timer.collect())
        if self.driver:
            assert gen is not None
            elapsed = time.perf_counter() - started
            metrics.update(gen.rollouts.metrics)
            if self.fleet is not None:  # read now: a loss during this step's sync or probe counts in this step
                metrics.update(self.fleet.fault_counts())
            if cfg.source.rollout_source == "fleet":  # how long engines and trainer waited for each other
                metrics.update(overlap_metrics(ran, train, (started, started + elapsed), waited))
            metrics["rollout/policy_lag"] = float(step - 1 - gen.version)
            metrics["data/dropped_prompts"] = float(loader.dropped)  # over --max-prompt-length, at load
            metrics["perf/time/step"] = elapsed
            metrics["perf/tokens_per_sec"] = gen.rollouts.metrics.get("rollout/num_tokens", 0.0) / elapsed
            dump_rollouts(cfg.run, step, gen.rollouts, self.dump_context)
        return metrics

    def _rollout_side(self) -> contextlib.AbstractContextManager[None]:
        """The driver's calls to the rollout side: after the exit signal, their failure is the job's stop."""
        signal = self.exit_signal if self.driver else None
        return stopped_with_the_job(lambda: signal is not None and signal.received_at is not None)

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

    def save(self, step: int, loader: PromptLoader) -> Path:
        """This run's checkpoint after ``step`` (collective; :class:`~megatron_pacs.checkpointing.RunCheckpoints`)."""
        # One step off: the next step's rollouts are done (the sync waited for them); they are kept with it.
        pending = self.producer.done if self.driver and self.producer is not None and self.pending_step else None
        with self.timer.phase("save"):
            return self.checkpoints.save(step, loader, pending_step=self.pending_step, pending_rollouts=pending)

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
            if self.driver and resumed.pending_rollouts is not None:
                assert self.producer is not None
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
                step()
            except Exception:
                log.exception("close: could not %s; going on with the rest of the shutdown", what)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
