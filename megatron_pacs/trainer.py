"""The training loop behind ``megatron_pacs.train``: set-up, the step, validation, weight sync, logging.

Rank 0 is the driver: it owns the fleet, the reward pool, the metric sinks and the rollout dumps; every rank owns
its model shard. Collectives in this file run on the default (world) group, which every rank joins in the same
order: the rollout distribution (each data-parallel rank receives its share as tensors), the metric gather inside
``train_on_batch``, and the weight export (TP gathers and PP broadcasts inside the exporter). With
``--off-policy-steps 1`` the driver generates the next step's rollouts in a background thread during the update
(:mod:`megatron_pacs.overlap`); with ``--colocate`` the engines sleep around it
(:mod:`megatron_pacs.rollout.colocate`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from megatron_pacs.algo.objectives import build_objective
from megatron_pacs.config import TrainConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.mcore.actor import Actor
from megatron_pacs.mcore.optim import Trainable, reset_optimizer_state
from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
from megatron_pacs.mcore.reference import ReferencePolicy
from megatron_pacs.overlap import Generated, RolloutProducer, overlap_metrics
from megatron_pacs.rl_step import StepRollouts, collect_rollouts, train_on_batch
from megatron_pacs.rollout.colocate import Colocation
from megatron_pacs.transport import distribute_rollouts
from megatron_pacs.utils.exit_signal import ExitSignal
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.metrics import MetricsWriter, PhaseTimer

__all__ = ["Trainer"]

log = get_logger("trainer")

CLOSE_WAIT_S = 30.0
"""How long :meth:`Trainer.close` waits for a generation in flight before stopping the fleet under it."""


class Trainer:
    """Builds the actor, the fleet and the sinks; :meth:`fit` runs the steps. Use as a context manager."""

    def __init__(self, cfg: TrainConfig, val_rows: dict[str, list[PromptRow]] | None = None) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.val_rows = cfg, val_rows or {}
        self.groups = init_parallel(cfg.parallel, seed=cfg.run.seed)
        self.rank = dist.get_rank()
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
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_model)
        self.log_dir = Path(cfg.run.log_dir)
        self.timer = PhaseTimer(cuda_sync=torch.cuda.is_available())
        self.fleet = self.scorer = None
        self.producer: RolloutProducer | None = None
        self.engine_version = 0  # the training step whose weights the engines hold
        self.pending_step: int | None = None  # a step whose rollouts are generated ahead (every rank knows)
        # Colocated, the training state leaves the GPU before the engines start (vLLM's start-up check wants
        # --gpu-memory-utilization of the GPU free); the engines own that memory until the first update.
        self.colocation = self._colocation()
        if self.colocation is not None:
            self.colocation.start()
        if self.driver:
            self._start_driver()
        if self.colocation is not None:
            self.colocation.engine = self.fleet
        self.exit_signal: ExitSignal | None = None
        if cfg.run.exit_signal_handler:  # after the fleet: ray.init installs a SIGTERM handler that this replaces
            self.exit_signal = ExitSignal(cfg.run.exit_signal_grace_seconds)
        self.writer: MetricsWriter | None = None

    def _colocation(self) -> Colocation | None:
        """The colocated cycle (``--colocate``); its engine is attached once the driver has started the fleet."""
        r = self.cfg.rollout
        if not r.colocate:
            return None
        return Colocation(None, self.actor if r.offload_optimizer_during_rollout else None)

    def _start_driver(self) -> None:
        from megatron_pacs.rewards.scorer import RewardScorer
        from megatron_pacs.rollout.fleet import RolloutFleet

        r, cfg = self.cfg.rollout, self.cfg
        # vLLM's "auto" runs fp32 checkpoints in half precision; default to the trainer's own dtype instead.
        dtype = r.rollout_dtype if r.rollout_dtype != "auto" else ("bfloat16" if cfg.model.bf16 else "float32")
        rw = cfg.reward
        self.scorer = RewardScorer(
            num_workers=rw.reward_workers, timeout_s=rw.reward_timeout, max_chars=rw.reward_max_chars or None
        )
        self.fleet = RolloutFleet(
            r,
            model=cfg.model.hf_model,
            dtype=dtype,
            max_model_len=cfg.batch.seq_length,
            seed=cfg.run.seed,
            run_dir=str(self.log_dir),
            progress=False,
        )
        self.producer = RolloutProducer(self._collect)

    def _collect(self, rows: list[PromptRow], step: int) -> StepRollouts:
        """Driver: generate, score and pack step ``step``'s rollouts (maybe in the producer's thread); their
        ``perf/time/generate`` and ``perf/time/reward`` travel with them, so a step reports its own rollouts' times
        whenever they were generated."""
        timer = PhaseTimer()
        rollouts = collect_rollouts(self.fleet, self.scorer, self.tokenizer, rows, self.cfg, step, timer)
        assert self.fleet is not None, "the driver owns the fleet"
        rollouts.metrics["rollout/engine_failures"] = float(self.fleet.num_restarts)  # engines lost in this run
        rollouts.metrics.update(timer.collect())
        return rollouts

    # -- the loop ----------------------------------------------------------------------------------------------

    def fit(self, loader: PromptLoader) -> list[dict[str, float]]:
        """Resume if ``--load`` holds a checkpoint, then run the remaining steps up to ``--train-iters``.

        Returns:
            Every step's metrics of this run (on every rank).
        """
        cfg = self.cfg
        start_step = self._resume_and_sync(loader) if cfg.checkpoint.load else 0
        self.writer = MetricsWriter(
            self.log_dir,
            enabled=self.driver,
            wandb_project=cfg.run.wandb_project,
            wandb_name=cfg.run.wandb_exp_name,
            config=cfg.to_dict(),
            total_steps=cfg.run.train_iters,
            start_step=start_step,
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
            for step in (s + 1 for s in bar):
                metrics = self.step(loader, step)
                if every and (step % every == 0 or step == cfg.run.train_iters):
                    metrics.update(self.validate())
                self.writer.log(step, metrics)
                history.append(metrics)
                last = step == cfg.run.train_iters
                ck = cfg.checkpoint
                saved = ck.save and ((ck.save_interval and step % ck.save_interval == 0) or last)
                if saved:
                    self.save(step, loader)
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

    def step(self, loader: PromptLoader, step: int) -> dict[str, float]:
        """One training step (collective): this step's rollouts (generated now, or during the previous step with
        ``--off-policy-steps 1``), the next step's generation started in the background, the update, a reference
        reset when due, then the weight sync once no generation is in flight."""
        cfg = self.cfg
        started = time.perf_counter()
        rows = None if self.pending_step == step else loader.next_batch()
        self.pending_step = None
        gen, ran, waited = None, [], 0.0  # this step's rollouts; generations run during it; trainer's wait
        if self.driver:
            assert self.producer is not None
            t0 = time.perf_counter()
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
        metrics = train_on_batch(
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
        self._check_consistency(metrics, step)
        if self.reference is not None:
            metrics.update(self._maybe_reset_reference(step, metrics))
        if self.driver and self.producer is not None and self.producer.in_flight:
            t0 = time.perf_counter()
            ran.append(self.producer.wait())
            waited += time.perf_counter() - t0
        with self.timer.phase("sync"):
            sync = self.colocation.after_train(self.sync_weights) if self.colocation else self.sync_weights()
        self.engine_version = step
        # with --max-logprob-diff every sync is probed and compared (the consistency check above sees only steps
        # whose rollouts came from the current weights: not those generated one step off or before a resume)
        bound = cfg.rollout.max_logprob_diff
        if bound is not None or step == 1 or (cfg.eval.eval_interval and step % cfg.eval.eval_interval == 0):
            sync["sync/max_logprob_diff"] = self._agreed(self.check_sync(batch))
            self._check_consistency(sync, step)
        metrics.update(sync)
        metrics.update(self.timer.collect())
        if self.driver:
            assert gen is not None
            elapsed = time.perf_counter() - started
            metrics.update(gen.rollouts.metrics)
            metrics.update(overlap_metrics(ran, train, (started, started + elapsed), waited))
            metrics["rollout/policy_lag"] = float(step - 1 - gen.version)
            metrics["perf/time/step"] = elapsed
            metrics["perf/tokens_per_sec"] = gen.rollouts.metrics.get("rollout/num_tokens", 0.0) / elapsed
            self._dump(gen.rollouts, step)
        return metrics

    def _distribute(self, gen: Generated | None) -> RolloutBatch:
        """Every rank's data-parallel share of the driver's rollouts (collective; tensors, not pickles)."""
        if dist.get_world_size() == 1:
            assert gen is not None
            return gen.rollouts.batch
        with self.timer.phase("distribute"):
            full = gen.rollouts.batch if gen is not None else None
            return distribute_rollouts(full, self.cfg.batch, self.groups)

    def _check_consistency(self, metrics: dict[str, float], step: int) -> None:
        """``--max-logprob-diff``: stop (on every rank alike: the metrics are global) when the engines' and the
        trainer's log-probs of the same tokens disagree by more than the bound: the rollouts' tokens
        (``consistency/logprob_abs_diff_max``) or the probe right after a weight sync (``sync/max_logprob_diff``)."""
        bound = self.cfg.rollout.max_logprob_diff
        for key, what in (
            ("consistency/logprob_abs_diff_max", "the rollouts' tokens"),
            ("sync/max_logprob_diff", "the sync probe's tokens, right after the weight sync"),
        ):
            worst = metrics.get(key)
            if bound is not None and worst is not None and worst > bound:
                raise RuntimeError(
                    f"step {step}: the engines' and the trainer's token log-probs ({what}) differ by up to "
                    f"{worst:.3g} > --max-logprob-diff {bound:g}: weights not synced, a different tokenizer or "
                    "dtype (docs/algorithm.md §7.1 lists the expected values)"
                )

    @staticmethod
    def _agreed(value: float) -> float:
        """The driver's ``value`` on every rank (the sync probe is compared on the driver only)."""
        if dist.get_world_size() == 1:
            return value
        out = [value]
        dist.broadcast_object_list(out, src=0)
        return float(out[0])

    def _maybe_reset_reference(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """At the end of every ``--ref-reset-interval``-th step: reference <- current policy (and Adam reset)."""
        assert self.reference is not None
        every = self.cfg.reference.ref_reset_interval
        if every and step % every == 0:
            self.reference.reset_from(self.actor)
            if self.cfg.reference.ref_reset_optimizer:
                reset_optimizer_state(self._trainable(), self.cfg.reference.ref_reset_lr_warmup_steps)
            log.info("step %d: reference reset to the current policy (reset #%d)", step, self.reference.resets)
        elif self.driver and not every and self.cfg.loss.pacs_score_reference == "ref" and "pacs/score/max" in metrics:
            # never reset: the score's range is the drift since the start (cfg.warnings)
            log.info("step %d: pacs/score in [%.3g, %.3g]", step, metrics["pacs/score/min"], metrics["pacs/score/max"])
        out = {"ref/resets": float(self.reference.resets)}
        if self.reference.offload:
            out["perf/time/ref_onload"], self.reference.seconds_onload = self.reference.seconds_onload, 0.0
        return out

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights into every engine (all ranks take part in the export)."""
        weights = self.actor.export_hf_weights()
        if self.driver:
            assert self.fleet is not None, "the driver owns the fleet"
            return self.fleet.update_weights(weights)
        for _ in weights:
            pass
        return {}

    def check_sync(self, batch: RolloutBatch, num_probes: int = 2) -> float:
        """Max |engine - trainer| token log-prob on a few of this step's sequences (after the sync), through vLLM's
        prompt log-probs. Only data-parallel rank 0's model-parallel group computes (its share's first sequences);
        every pipeline stage of it receives the trainer's log-probs, so the driver compares under PP too."""
        from megatron_pacs.data.batching import pad_rows
        from megatron_pacs.mcore.forward import token_logprobs

        if self.groups.dp_rank != 0:
            return 0.0
        rows = batch.held.nonzero().flatten()[:num_probes].tolist()
        tokens, _, _ = pad_rows(batch, rows)
        with self.actor.fp8_passes(False):  # the engines run bf16: an FP8 pass would add FP8's own gap (§7.2)
            logp = token_logprobs(
                self.actor.chunks, self.groups, tokens, micro_batch_size=len(rows), impl=self.actor.logprob_impl
            )
        if not self.driver:
            return 0.0
        assert self.fleet is not None, "the driver owns the fleet"
        probes = [batch.sequence(i).tolist() for i in rows]
        refs = [logp[j, : len(probes[j]) - 1].tolist() for j in range(len(rows))]
        return self.fleet.verify_sync(probes, refs)

    def validate(self) -> dict[str, float]:
        """Mean reward per validation source, greedy by default (driver only; the others return {})."""
        if not self.driver or not self.val_rows:
            return {}
        assert self.fleet is not None and self.scorer is not None, "the driver owns the fleet and the scorer"
        from megatron_pacs.rollout.types import SamplingConfig

        started = time.perf_counter()
        ev = self.cfg.eval
        sampling = SamplingConfig(
            n=ev.val_n,
            temperature=ev.val_temperature,
            top_p=self.cfg.rollout.top_p,
            max_tokens=self.cfg.batch.max_response_length,
            seed=self.cfg.run.seed,
            stop_token_ids=[self.tokenizer.eos_token_id],
            logprobs=False,
        )
        out = {}
        for source, rows in self.val_rows.items():
            prompts = [apply_chat_template(self.tokenizer, r.prompt) for r in rows]
            groups = self.fleet.generate(prompts, sampling)
            texts = [resp.text for g in groups for resp in g.responses]
            scored = self.scorer.score(texts, [r.ground_truth for r in rows for _ in range(ev.val_n)])
            out[f"val/{source}/reward_mean"] = sum(scored.scores) / max(1, len(scored.scores))
        out["perf/time/validate"] = time.perf_counter() - started
        return out

    def _dump(self, rollouts: StepRollouts, step: int) -> None:
        if not self.cfg.run.dump_rollouts:
            return
        folder = self.log_dir / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step_{step:06d}.jsonl", "w", encoding="utf-8") as f:
            for rec in rollouts.records:
                f.write(json.dumps(rec) + "\n")

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save(self, step: int, loader: PromptLoader) -> Path:
        """Model + optimizer + RNG + step + data position (+ a HF directory with ``--save-hf``). Collective."""
        from megatron_pacs.mcore.checkpoint import save_hf_checkpoint
        from megatron_pacs.mcore.train_checkpoint import save_training_checkpoint

        with self.timer.phase("save"):
            ck, trainable = self.cfg.checkpoint, self._trainable()
            meta = {
                "loader": loader.state_dict(),
                "lr_schedule": trainable.schedule.state_dict(),
                "optimizer_reset_pending": trainable.reset_pending,
                "pending_step": self.pending_step,
                "config": self.cfg.to_dict(),
            }
            # One step off: the next step's rollouts are done (the sync waited for them); keep them, since the
            # weights that generated them are gone.
            driver_objects = {}
            if self.driver and self.producer is not None and self.producer.done is not None:
                driver_objects["pending_rollouts"] = self.producer.done
            extra = {}
            if self.reference is not None:
                meta["reference"] = {"resets": self.reference.resets, "equals_actor": self.reference.equals_actor}
                if self.reference.resets:  # the weights differ from --ref-load only after a reset
                    extra["reference"] = self.reference.models
            assert ck.save is not None
            path = save_training_checkpoint(
                ck.save,
                step,
                trainable.models,
                trainable.optimizer,
                meta,
                keep_last=ck.keep_last,
                extra_models=extra,
                driver_objects=driver_objects,
            )
            if ck.save_hf:
                save_hf_checkpoint(
                    self.actor.export_hf_weights(), path / "hf", side_files_from=self.cfg.model.hf_model, progress=False
                )
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
        """Load the newest complete checkpoint under ``--load`` (resharded to this layout); returns its step (0
        when there is none yet: a fresh start from ``--hf-model``). The caller pushes the weights to the fleet."""
        from megatron_pacs.config.resume import resume_changes
        from megatron_pacs.mcore.checkpoint import META_FILE
        from megatron_pacs.mcore.checkpoint import read_checkpoint_metadata as meta_of
        from megatron_pacs.mcore.train_checkpoint import find_latest_checkpoint, load_training_checkpoint

        assert self.cfg.checkpoint.load is not None
        root = Path(self.cfg.checkpoint.load)
        ckpt = root if (root / META_FILE).is_file() else find_latest_checkpoint(root)
        if ckpt is None:
            log.info("--load %s holds no complete checkpoint yet: starting from --hf-model", root)
            return 0
        saved = meta_of(ckpt)
        if "config" in saved:  # refuses a change that breaks the saved state, reports the others
            pending = saved.get("pending_step") is not None
            changes = resume_changes(saved["config"], self.cfg.to_dict(), pending_rollouts=pending)
            if changes and self.driver:
                log.warning("resuming %s with changed settings: %s", ckpt, "; ".join(changes))
        loader.load_state_dict(saved["loader"])  # a position saved for other data is refused before any load
        trainable = self._trainable()
        resets = int(meta_of(ckpt).get("reference", {}).get("resets", 0))
        extra = {"reference": self.reference.models} if self.reference is not None and resets else {}
        meta = load_training_checkpoint(ckpt, trainable.models, trainable.optimizer, extra_models=extra)
        loader.load_state_dict(meta["loader"])
        trainable.schedule.load_state_dict(meta["lr_schedule"])
        trainable.reset_pending = bool(meta.get("optimizer_reset_pending", False))
        self.pending_step = meta.get("pending_step")
        if self.driver and self.pending_step is not None:
            assert self.producer is not None
            self.producer.done = torch.load(ckpt / "pending_rollouts.pt", weights_only=False)
        if self.reference is not None:
            self.reference.resets = resets
            self.reference.equals_actor = bool(meta.get("reference", {}).get("equals_actor", False))
        self.engine_version = int(meta["step"])
        return int(meta["step"])

    def _trainable(self) -> Trainable:
        assert self.actor.trainable is not None, "the trainer's actor always has an optimizer"
        return self.actor.trainable

    # -- teardown ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self.exit_signal is not None:
            self.exit_signal.finish()
        # Bounded and exhaustive: a generation stuck in flight is waited for CLOSE_WAIT_S at most (stopping the
        # fleet then ends it), and a step that fails is logged without skipping the ones after it.
        producer, writer, fleet, scorer = self.producer, self.writer, self.fleet, self.scorer
        steps: list[tuple[str, Callable[[], object]]] = []
        if producer is not None:
            steps.append(("wait for the generation in flight", lambda: producer.close(timeout=CLOSE_WAIT_S)))
        if writer is not None:
            steps.append(("close the metric sinks", writer.close))
        if fleet is not None:
            steps.append(("shut the fleet down", fleet.shutdown))
        if producer is not None:
            steps.append(("stop the generation thread", lambda: producer.close(timeout=0.0)))
        if scorer is not None:
            steps.append(("stop the reward pool", scorer.close))
        steps.append(("destroy the process groups", destroy_parallel))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.exception("close: could not %s; going on with the rest of the shutdown", what)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
