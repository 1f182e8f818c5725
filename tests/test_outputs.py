"""A run's output folders, checked before anything starts (megatron_pacs/outputs.py): a fresh run into a
``--log-dir`` that holds another run (metrics of some step, or rollout dumps) is refused naming it, unless the
checkpoint ``--load`` resumes was written by that run or the job is the same one started again before its first
checkpoint; an unwritable ``--save`` or ``--log-dir`` is refused naming the flag (not a raw ``OSError``
traceback); the default ``--log-dir`` is one folder per run (``<--save>/logs`` with ``--save``). Each runs the
CLI's ``main`` in this process: a refusal returns before Megatron, Ray or any engine starts. The checkpoint here is
a folder of metadata only, as the trainer writes it."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.runs import TINY_SHAPE_FLAGS
from helpers.tiny_folders import make_model, make_problems

from megatron_pacs.config import parse_config
from megatron_pacs.outputs import check_outputs, resolve_log_dir
from megatron_pacs.train import main

FLAGS = TINY_SHAPE_FLAGS
SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run_dir")
    make_model(root / "model")
    make_problems(root / "train.jsonl")
    return root


def _argv(root: Path, *extra: str) -> list[str]:
    return ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *FLAGS, *SYNTHETIC, *extra]


def _another_run(log_dir: Path, *, metrics: bool = True, dumps: bool = False) -> Path:
    """What a run leaves in its log dir: metrics of steps 1-2, and/or the rollout dumps of step 1."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if metrics:
        (log_dir / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "train/loss": 0.5}) + "\n" for s in (1, 2))
        )
    if dumps:
        (log_dir / "rollouts").mkdir()
        (log_dir / "rollouts" / "step_000001.safetensors").write_bytes(b"")
    return log_dir


def _checkpoint(root: Path, step: int, log_dir: Path) -> Path:
    """A checkpoint folder's metadata as RunCheckpoints.save writes it, with the run's configuration's log dir."""
    ckpt = root / f"iter_{step:07d}"
    ckpt.mkdir(parents=True)
    meta = {"step": step, "loader": {}, "written_at": 1.0, "parent": None, "config": {"run": {"log_dir": str(log_dir)}}}
    (ckpt / "megatron_pacs.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    return root


def test_a_fresh_run_into_a_log_dir_of_another_run_is_refused_naming_it(setup, tmp_path):
    """Two fresh runs in one --log-dir gave metrics.jsonl steps [1, 1] and dumps of the last run only."""
    log_dir = _another_run(tmp_path / "run")
    with pytest.raises(ValueError, match=rf"--log-dir {log_dir} holds another run \(metrics.jsonl with steps 1-2\)"):
        main(_argv(setup, "--log-dir", str(log_dir)))
    dumps_only = _another_run(tmp_path / "dumps", metrics=False, dumps=True)
    with pytest.raises(
        ValueError, match=r"holds another run \(rollout dumps of 1 step\(s\) in .*; pass a new --log-dir"
    ):
        main(_argv(setup, "--log-dir", str(dumps_only)))
    assert len((log_dir / "metrics.jsonl").read_text().splitlines()) == 2  # untouched


def test_the_default_log_dir_is_one_per_run_and_under_save_with_save(setup, tmp_path):
    """Without --log-dir: <--save>/logs (so a resume finds it: a fresh run there is refused naming it), else a new
    runs/run-<UTC time>-<pid>."""
    ckpt = tmp_path / "ckpt"
    _another_run(ckpt / "logs")
    with pytest.raises(ValueError, match=rf"--log-dir {ckpt / 'logs'} holds another run"):
        main(_argv(setup, "--save", str(ckpt)))
    cfg = parse_config(_argv(setup))
    assert resolve_log_dir(cfg).startswith(os.path.join("runs", "run-")) and str(os.getpid()) in cfg.run.log_dir


def test_a_run_resuming_the_log_dirs_run_is_accepted(setup, tmp_path):
    """--load naming a checkpoint that the log dir's own run wrote continues it (the sinks drop its later steps)."""
    log_dir = _another_run(tmp_path / "run")
    ckpt = _checkpoint(tmp_path / "ckpt", 1, log_dir)
    check_outputs(parse_config(_argv(setup, "--log-dir", str(log_dir), "--load", str(ckpt))))
    other = _checkpoint(tmp_path / "other_ckpt", 1, tmp_path / "elsewhere")
    cfg = parse_config(_argv(setup, "--log-dir", str(log_dir), "--load", str(other)))
    with pytest.raises(ValueError, match=rf"the checkpoint --load resumes logged to {tmp_path / 'elsewhere'}"):
        check_outputs(cfg)


def test_a_job_requeued_before_its_first_checkpoint_starts_again_in_its_log_dir(setup, tmp_path):
    """--save X --load X logging under X/logs, with no checkpoint yet: the first attempt's lines are its own, so the
    start is accepted and the metrics writer drops them (the steps run again)."""
    from megatron_pacs.utils.sinks import MetricsWriter

    ckpt = tmp_path / "ckpt"
    _another_run(ckpt / "logs")
    cfg = parse_config(_argv(setup, "--save", str(ckpt), "--load", str(ckpt)))
    resolve_log_dir(cfg)
    check_outputs(cfg)
    with MetricsWriter(cfg.run.log_dir, tensorboard=False, fresh=True) as writer:  # as the trainer's at step 0
        writer.log(1, {"train/loss": 0.25})
    rows = [json.loads(line) for line in (ckpt / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["train/loss"] == 0.25


@pytest.fixture
def read_only(tmp_path):
    """A read-only filesystem (a tmpfs mounted ``ro``: root writes through permission bits); skipped where this
    process may not mount."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("flag", ["--save", "--log-dir"])
def test_an_unwritable_save_or_log_dir_is_refused_naming_the_flag(setup, tmp_path, read_only, flag):
    other = ["--log-dir", str(tmp_path / "run")] if flag == "--save" else []
    target = read_only / "out"
    with pytest.raises(ValueError, match=rf"{flag} {target}: not writable: EROFS \(Read-only file system\)"):
        main(_argv(setup, flag, str(target), *other))
