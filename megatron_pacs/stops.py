"""How a run stops, and what it keeps: the exit signal, the rollout side lost, a failed write into ``--log-dir``.

:class:`RunStops` holds :class:`~megatron_pacs.trainer.Trainer`'s decisions around :meth:`Trainer.fit`'s loop: after
each step, whether to save and stop (the exit signal: every rank stops after the same step, saved); when the rollout
side is lost in the middle of a step, which update the weights hold and that it is saved and logged; when a write
into ``--log-dir`` fails (a full disk), the update kept and the one line that says so. The trainer's state it reads
is declared below.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.distribute import send_stop
from megatron_pacs.rollout.lost import RolloutClusterLost, stopped_with_the_job
from megatron_pacs.utils.log_writes import LogWriteError, any_rank
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    from megatron_pacs.checkpointing import RunCheckpoints
    from megatron_pacs.config import TrainConfig
    from megatron_pacs.utils.exit_signal import ExitSignal
    from megatron_pacs.utils.sinks import MetricsWriter

__all__ = ["RunStops"]

log = get_logger("trainer")


class RunStops:
    """The trainer's stops (a base of :class:`~megatron_pacs.trainer.Trainer`; see the module docstring)."""

    cfg: TrainConfig
    driver: bool
    checkpoints: RunCheckpoints
    exit_signal: ExitSignal | None
    writer: MetricsWriter | None
    samples: list[dict]
    pending_step: int | None
    updated: tuple[int, dict]  # the last step whose update the weights hold, and the data position after it
    unsynced: tuple[int, dict[str, float]]  # that update's metrics, until its weight sync is done
    saved_step: int

    def step(self, loader: PromptLoader, step: int) -> dict[str, float]: ...

    def save(
        self, step: int, loader: PromptLoader, *, background: bool = False, position: dict | None = None
    ) -> Path: ...

    def _step_unless_lost(self, loader: PromptLoader, step: int) -> dict[str, float] | None:
        """:meth:`step`; None when the rollout side was lost after the job's exit signal (the last update saved).
        A failed write into ``--log-dir`` (the step's dumps, before its update) saves the last update the weights
        hold, as a lost rollout side does, and stops the run."""
        self.checkpoints.poll()  # --async-save: the save in flight committed once every rank's writes are done
        try:
            return self.step(loader, step)
        except LogWriteError as failure:
            send_stop()  # the driver: in place of the rollouts the others wait for
            self._kept(failure, self._save_last_update(loader))
            raise
        except RolloutClusterLost:  # not back within --rollout-cluster-reconnect-seconds (§6.3)
            send_stop()  # the driver: in place of the rollouts the others wait for
            done = self._save_last_update(loader)
            self._log_unsynced(done)
            if self.exit_signal is None or self.exit_signal.received_at is None:
                raise
            # a scheduler stopping the job signals every step of it, the rollout cluster's too (hetjob)
            log.warning("exit signal: the rollout side failed after it; stopped after step %d; exiting 0", done)
            return None

    def _log_unsynced(self, done: int) -> None:
        """The row of step ``done`` when its update is saved but the weight sync after it failed: its update's and
        rollouts' metrics (no sync or timing), so the record has every step the weights hold."""
        step, metrics = self.unsynced
        if step == done and self.writer is not None:
            with contextlib.suppress(LogWriteError):  # the run stops on the lost rollout side either way
                self.writer.log(step, metrics)

    def _log_or_stop(self, step: int, metrics: dict[str, float], loader: PromptLoader) -> bool:
        """The step's metrics into the sinks (collective where there are several ranks: whether the driver's write
        failed). A failed write (a full disk) saves this step's update when --save is set, then stops the run: the
        driver raises the one line naming the file, the step and the OS error; the others return True."""
        failure = None
        try:
            if self.writer is not None:
                self.writer.log(step, metrics)
                self.writer.log_samples(step, self.samples)  # --log-samples: to TensorBoard and W&B
        except LogWriteError as exc:
            failure = exc
        if not any_rank(failure is not None):
            return False
        if self.cfg.checkpoint.save and self.saved_step < step:
            self.save(step, loader)
            self.saved_step = step
        if failure is None:
            return True
        self._kept(failure, step)
        raise failure

    def _kept(self, failure: LogWriteError, done: int) -> None:
        """Say in ``failure``'s line what the run kept: the update of step ``done`` (saved when --save is set)."""
        save = self.cfg.checkpoint.save
        if not done:
            failure.outcome = "stopped before the first update (nothing to keep)"
        elif save:
            failure.outcome = f"stopped; step {done}'s update is saved: free space and resume with --load {save}"
        else:
            failure.outcome = f"stopped; step {done}'s update is not kept (no --save)"

    def _save_or_stop(self, step: int, loader: PromptLoader) -> bool:
        """The checkpoint when due; then True when the exit signal stops the run (saved after this step)."""
        saved = self.checkpoints.due(step)
        if saved:  # --async-save: written in the background, but the run's last save is waited for
            self.save(step, loader, background=step < self.cfg.run.train_iters)
            self.saved_step = step
        if self.exit_signal is None or step == self.cfg.run.train_iters or not self.exit_signal.should_stop():
            return False
        log.warning("exit signal: every rank stops after step %d", step)
        if self.cfg.checkpoint.save and not saved:
            self.save(step, loader)
        self.checkpoints.wait()
        log.warning("exit signal: stopped after step %d (checkpoint: %s); exiting 0", step, self.cfg.checkpoint.save)
        return True

    def _save_last_update(self, loader: PromptLoader) -> int:
        """After the rollout side failed in the middle of a step: save the last step whose update the weights hold
        (this one when the failure came after its update, during the weight sync; else the one before), at the data
        position right after that step's own prompts (prompts drawn ahead for the next step go back). Returns it."""
        done, position = self.updated
        if self.cfg.checkpoint.save and done > self.saved_step:
            loader.load_state_dict(position)
            self.pending_step = None  # rollouts generated ahead are lost with the step; a resume generates them
            self.save(done, loader, position=position)
            self.saved_step = done
        return done

    def _rollout_side(self) -> contextlib.AbstractContextManager[None]:
        """The driver's calls to the rollout side: after the exit signal, their failure is the job's stop."""
        signal = self.exit_signal if self.driver else None
        return stopped_with_the_job(lambda: signal is not None and signal.received_at is not None)
