"""PACS (or GRPO) RLVR training: Megatron-Core actor, Ray-managed vLLM fleet, math-verify rewards.

Every rank runs this same SPMD program; rank 0 also drives the fleet and the reward pool::

    torchrun --nnodes 8 --nproc-per-node 8 ... -m megatron_pacs.train --hf-model Qwen2.5-7B --train-data ...
    python -m megatron_pacs.train --hf-model DIR --train-data FILE ...     # one process (CPU or one GPU)
    python -m megatron_pacs.train ... --dry-run --world-size 64            # check a layout on any machine

One step: prompts -> fleet.generate (n per prompt) -> rewards -> broadcast -> old log-probs where needed ->
per mini-batch a PACS two-phase update through Megatron's forward_backward_func -> weights into the fleet.
"""

from __future__ import annotations

import os
import sys

from megatron_pacs.config import TrainConfig, parse_config
from megatron_pacs.outputs import check_outputs, describe_outputs, resolve_log_dir
from megatron_pacs.rollout.lost import RolloutClusterLost
from megatron_pacs.utils.checkpoint_dirs import CheckpointWriteError
from megatron_pacs.utils.interrupts import (
    end_process,
    exiting,
    interrupted_line,
    interruption_of,
    raise_on_sigint,
    raise_on_sigterm,
)
from megatron_pacs.utils.log_writes import LogWriteError
from megatron_pacs.utils.run_failure import RunFailure

ONE_LINE_FAILURES = (RolloutClusterLost, CheckpointWriteError, LogWriteError, RunFailure)
"""Failures whose message is the whole story (what, the flag, the fix): the run ends with that line and exits 1."""


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    cfg.model.resolve_hub_id()  # a hub id in the local cache: its folder from here on (never a download)
    if cfg.run.dry_run:
        from megatron_pacs.planner import dry_run  # pure arithmetic, no torch: instant

        return dry_run(cfg)
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))  # before any model, engine or process group exists
    resolve_log_dir(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # one folder per run by default
    if cfg.checkpoint.load is not None:
        from megatron_pacs.checkpointing import check_load_at_start

        step = check_load_at_start(cfg)  # a checkpoint of another model shape is refused here
        if step is not None and step >= cfg.run.train_iters:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"nothing to train: the checkpoint is at step {step} and --train-iters is {cfg.run.train_iters}")
            return 0
    check_outputs(cfg)  # writable; a --log-dir holding another run is refused unless this run resumes it
    if int(os.environ.get("RANK", "0")) == 0:
        from megatron_pacs.utils.logging import get_logger

        get_logger("train").info(describe_outputs(cfg))
    lock = None
    if cfg.checkpoint.save is not None and int(os.environ.get("RANK", "0")) == 0:
        from megatron_pacs.utils.checkpoint_dirs import remove_stale_temp_folders
        from megatron_pacs.utils.run_lock import RunLock

        lock = RunLock(cfg.checkpoint.save)  # one run per --save, held for the whole run
        lock.acquire()
        remove_stale_temp_folders(cfg.checkpoint.save)  # the lock proves no other run is writing them
    try:
        return _train(cfg)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: TrainConfig) -> int:
    from megatron_pacs.data.loader import PromptLoader
    from megatron_pacs.data.prepare import load_prompts
    from megatron_pacs.data.tokenizer import load_checked_tokenizer

    tokenizer = load_checked_tokenizer(cfg.model.hf_model)  # a missing or empty one would train on empty prompts
    train_rows, val_rows, dropped = load_prompts(cfg.data, tokenizer, cfg.batch.max_prompt_length)

    loader = PromptLoader(train_rows, cfg.batch.global_batch_size, seed=cfg.run.seed, dropped=dropped)
    if cfg.checkpoint.load is not None:
        from megatron_pacs.checkpointing import plan_resume

        plan_resume(cfg, loader)  # a changed seed or data set, damaged metadata: refused before any model is built

    from megatron_pacs.trainer import Trainer

    with Trainer(cfg, val_rows) as trainer:
        try:
            trainer.fit(loader)
        except (RolloutClusterLost, LogWriteError, RunFailure):  # one line at the exit (below)
            raise
        except Exception as exc:
            from megatron_pacs.mcore.parallel import lost_rank

            if trainer.heartbeat is not None and trainer.heartbeat.fired:
                # a consequence of the loss the heartbeat reported (it killed the engines): it dumps and exits
                trainer.heartbeat.await_exit()
                raise
            rank = lost_rank(trainer.groups, exc)
            if rank is None:  # e.g. a collective's own timeout (a stalled peer): the other threads' stacks too
                trainer.stacks.dump(f"the run failed: {exc!r}")
                raise
            host = trainer.groups.rank_addresses[rank]
            trainer.stacks.dump(f"lost training rank {rank} (host {host}): a collective with it failed: {exc}")
            raise RuntimeError(f"lost training rank {rank} (host {host}): a collective with it failed: {exc}") from exc
    if trainer.exit_signal is not None and trainer.exit_signal.received_at is not None:
        from megatron_pacs.utils.exit_signal import report_clean_stop

        report_clean_stop()  # megatron_pacs.torchrun exits 0 once every local rank has
    return 0


def cli(argv: list[str] | None = None) -> int:
    """:func:`main` as the command runs it: the exit status, and one line on stderr for what ends a run early.

    Bad flags or data (``ValueError``: the message names the flag and the fix) exit 2; a lost rollout cluster, a
    full disk under ``--save`` or ``--log-dir`` and the other :data:`ONE_LINE_FAILURES` exit 1; Ctrl-C and SIGTERM,
    also where they surfaced wrapped (e.g. by Ray's Cython code), exit 130 and 143. Anything else keeps its
    traceback (a bug).
    """
    try:
        return main(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ONE_LINE_FAILURES as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        interruption = None if isinstance(exc, SystemExit) else interruption_of(exc)
        if interruption is None:
            raise
        line, code = interrupted_line(interruption)
        print(line, file=sys.stderr)
        exiting()  # a hang from here on is the interpreter's exit: the watchdog's line says so
        return code


if __name__ == "__main__":
    raise_on_sigterm()  # SIGTERM and Ctrl-C end the run with one line (cli); --exit-signal-handler replaces it
    raise_on_sigint()
    end_process(cli())
