"""``python -m megatron_pacs.torchrun`` (the recipes' launcher): torchrun's agent exits 1 on the SIGTERM a scheduler
sends to every process; the launcher exits 0 when every local rank stopped cleanly, and fails otherwise. Real
torch elastic agents with two ranks each (tests/torchrun_rank.py stands in for a training rank's stop)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_pacs.torchrun import STOP_MARKER_ENV, all_ranks_stopped_cleanly, latest_saved_step
from megatron_pacs.utils.launch import free_port

HERE = Path(__file__).parent


def _preempt(tmp_path: Path, *rank_args: str, usr1_first: bool = False, **extra_env: str) -> tuple[int, str]:
    """Launch two ranks, wait until both run, SIGTERM every process of the job (its process group), return the
    launcher's exit code and output. ``usr1_first``: first send SIGUSR1 to the launcher alone and wait until both
    ranks got it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env)
    for attempt in range(3):
        # free_port() only finds a port free: another process can take it before torchrun's store binds it
        # (EADDRINUSE, once in a clean-clone run beside the cluster tests); the launcher then fails at once
        cmd = [sys.executable, "-m", "megatron_pacs.torchrun", "--nproc-per-node", "2"]
        cmd += ["--master-port", str(free_port()), str(HERE / "torchrun_rank.py"), str(tmp_path), *rank_args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        if proc.poll() is None or attempt == 2:
            break
        out = proc.communicate(timeout=10)[0]
        if "EADDRINUSE" not in out:
            raise AssertionError(out)
    try:
        assert len(list(tmp_path.glob("ready.*"))) == 2, proc.communicate(timeout=10)[0]
        if usr1_first:
            os.kill(proc.pid, signal.SIGUSR1)
            while len(list(tmp_path.glob("usr1.*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert proc.poll() is None, "the launcher died of SIGUSR1"
        os.killpg(proc.pid, signal.SIGTERM)  # as Slurm does: every process of the job
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode, out


@pytest.mark.waits
def test_a_preempted_job_whose_ranks_all_stopped_cleanly_exits_0(tmp_path):
    code, out = _preempt(tmp_path)
    assert code == 0, out
    assert "every local rank stopped cleanly" in out


@pytest.mark.waits
def test_sigusr1_to_the_launcher_reaches_every_rank_and_stops_nothing(tmp_path):
    """A stack-dump request sent to the launcher (``scancel --signal=USR1`` signals it too) is passed on to the
    ranks; torch elastic's agent alone would die of it, ending the job."""
    code, out = _preempt(tmp_path, usr1_first=True)
    assert sorted(p.name for p in tmp_path.glob("usr1.*")) == ["usr1.0", "usr1.1"], out
    assert code == 0, out


@pytest.mark.waits
def test_a_preempted_job_with_a_rank_that_failed_exits_non_zero(tmp_path):
    code, out = _preempt(tmp_path, "fail")
    assert code != 0, out


@pytest.mark.parametrize(
    ("reports", "clean"),
    [({"0": "2", "1": "2"}, True), ({"0": "2"}, False), ({}, False), ({"0": "1"}, True), ({"0": "2", "1": "3"}, False)],
)
def test_clean_stop_reports_must_cover_every_local_rank(tmp_path, reports, clean):
    for rank, world in reports.items():
        (tmp_path / rank).write_text(world)
    assert all_ranks_stopped_cleanly(tmp_path) is clean


def _saved(tmp_path: Path, step: int) -> Path:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    return save


@pytest.mark.waits
def test_a_clean_stop_leaves_the_marker_a_batch_script_requeues_on(tmp_path):
    """With MEGATRON_PACS_STOP_MARKER set, a clean stop on SIGTERM writes the JSON marker examples/slurm/ reads:
    the signal, the local ranks and the step of the latest checkpoint under the trainer's --save."""
    marker = tmp_path / "stops" / "node0.json"
    code, out = _preempt(tmp_path, "--save", str(_saved(tmp_path, 7)), **{STOP_MARKER_ENV: str(marker)})
    assert code == 0, out
    written = json.loads(marker.read_text())
    assert {k: written[k] for k in ("stopped_on", "local_ranks", "step")} == {
        "stopped_on": "SIGTERM",
        "local_ranks": 2,
        "step": 7,
    }


@pytest.mark.waits
def test_no_marker_when_a_rank_failed(tmp_path):
    marker = tmp_path / "node0.json"
    code, out = _preempt(tmp_path, "fail", **{STOP_MARKER_ENV: str(marker)})
    assert code != 0 and not marker.exists(), out


def test_latest_saved_step_reads_the_trainers_save_flag(tmp_path):
    save = _saved(tmp_path, 12)
    assert latest_saved_step(["-m", "megatron_pacs.train", "--save", str(save), "--lr", "1"]) == 12
    assert latest_saved_step(["--save=" + str(save)]) == 12
    assert latest_saved_step(["--save", str(tmp_path / "none")]) is None
    assert latest_saved_step(["--lr", "1"]) is None


def test_latest_saved_step_reads_save_from_the_runs_config_file(tmp_path):
    """A --save given only in --config FILE.yaml (the command line's own --save still wins)."""
    save = _saved(tmp_path, 7)
    config = tmp_path / "run.yaml"
    config.write_text(f"checkpoint:\n  save: {save}\n")
    assert latest_saved_step(["-m", "megatron_pacs.train", "--config", str(config)]) == 7
    assert latest_saved_step(["--config", str(config), "--save", str(tmp_path / "none")]) is None
