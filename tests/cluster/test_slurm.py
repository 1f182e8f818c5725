"""The tiny job under a real Slurm (tests/cluster/slurm.py): ``examples/slurm/tiny.sbatch`` on 2 nodes x 1 rank
(gloo), trained on synthetic rollouts (``ROLLOUT_SOURCE=synthetic``: no Ray cluster). A plain run equals the same
run launched directly; a run preempted with ``scancel --signal=TERM`` and one signalled by ``--signal=TERM@N``
before its time limit save, requeue themselves, resume and complete; a too-short ``--signal`` margin is refused
before any node works. Each fault's times are printed (``-s`` or ``--durations`` shows them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cluster_fixtures import cluster_setup, netns_ok  # noqa: F401 - fixtures
from conftest import PINNED_CPU_ENV
from slurm import SlurmCluster, slurm_unavailable

from megatron_pacs.utils.launch import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "slurm" / "tiny.sbatch"
VENV_BIN = Path(sys.executable).parent
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm")
STEPS = "6"  # the plain and preempted runs: room to signal one mid-run (a tiny step takes ~0.4 s)
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def slurm(netns_ok, tmp_path_factory) -> Iterator[SlurmCluster]:  # noqa: F811
    """Slurm on a controller and 2 node hosts; skipped where it cannot run (a failure under ``CI=true``)."""
    why = slurm_unavailable()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the Slurm tests cannot run: {why}")
        pytest.skip(why)
    previous = signal.signal(signal.SIGTERM, _terminated)  # a SIGTERM to pytest still tears the cluster down
    try:
        with SlurmCluster(["node0", "node1"], tmp_path_factory.mktemp("slurm")) as cluster:
            print(f"\nslurm: controller and 2 idle nodes in {cluster.setup_seconds:.1f}s")
            assert cluster.setup_seconds <= 60
            yield cluster
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not cluster.cluster.exists(), "the Slurm cluster's namespaces or bridge are left behind"


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"pytest got signal {signum}")


def _env(setup: Path, run: Path, **extra: str) -> dict[str, str]:
    env = dict(
        PINNED_CPU_ENV,
        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME="eth0",
        ROLLOUT_SOURCE="synthetic",
        HF_MODEL=str(setup / "model"),
        TRAIN_DATA=str(setup / "train.jsonl"),
        SAVE_DIR=str(run / "ckpt"),
        LOG_DIR=str(run / "logs"),
        TRAIN_ITERS=STEPS,
        SAVE_INTERVAL="100",  # checkpoints at the end, and at a stop on the exit signal
        STOP_DIR=str(run / "stops"),
    )
    env.update(extra)
    return env


def _metrics(run: Path) -> list[dict]:
    path = run / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows if "train/loss" in r]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "ckpt" / f"iter_{step:07d}" / "hf" / "model.safetensors"))


@dataclass
class Plain:
    """The plain sbatch run and the same run launched directly."""

    run: Path
    direct: Path
    seconds: float


def _submit(slurm: SlurmCluster, run: Path, *sbatch_args: str, **env: str) -> int:
    run.mkdir(parents=True, exist_ok=True)
    return slurm.sbatch("-o", str(run / "job.out"), *sbatch_args, str(TINY), "--save-hf", cwd=ROOT, **env)


def _job_out(run: Path) -> str:
    path = run / "job.out"
    return path.read_text(errors="replace")[-8000:] if path.exists() else "(no job output)"


@pytest.fixture(scope="module")
def plain(slurm, cluster_setup, tmp_path_factory) -> Plain:  # noqa: F811
    """``sbatch tiny.sbatch`` to completion and, at the same time, the same job launched directly: 2 local ranks
    through ``python -m megatron_pacs.torchrun`` (examples/tiny_cluster.sh with NNODES=1, GPUS_PER_NODE=2)."""
    root = tmp_path_factory.mktemp("plain")
    run, direct = root / "sbatch", root / "direct"
    started = time.monotonic()
    job = _submit(slurm, run, **_env(cluster_setup, run))
    env = dict(os.environ, **_env(cluster_setup, direct), NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()))
    env.pop("GLOO_SOCKET_IFNAME")
    direct.mkdir()
    with open(direct / "out.log", "wb") as out:
        proc = subprocess.run(
            ["bash", "examples/tiny_cluster.sh", "--save-hf"], env=env, cwd=ROOT, stdout=out, stderr=out, timeout=300
        )
    assert proc.returncode == 0, (direct / "out.log").read_text(errors="replace")[-6000:]
    fields = slurm.wait_state(job, FINISHED, timeout=240)
    seconds = time.monotonic() - started
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", (fields, _job_out(run))
    print(f"\nplain run: sbatch to COMPLETED in {seconds:.1f}s (the direct run alongside)")
    return Plain(run, direct, seconds)


def test_sbatch_runs_the_tiny_job_to_completion_equal_to_the_direct_launch(plain):
    rows = _metrics(plain.run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1))
    assert rows == _metrics(plain.direct)
    a, b = _weights(plain.run, int(STEPS)), _weights(plain.direct, int(STEPS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = _job_out(plain.run)
    assert "training finished" in out and "requeueing" not in out, out
    assert not list((plain.run / "stops").glob("*.json"))


def _follow(slurm: SlurmCluster, job: int, run: Path, timeout: float) -> dict:
    """Seconds from now to: a checkpoint before the last step (the graceful save), the job requeued, running again,
    and finished; polls until the job finishes (bounded) and returns what it saw, with the metrics rows the first
    start had logged when the job was requeued (``first_rows``)."""
    started, seen = time.monotonic(), {}
    while time.monotonic() - started < timeout:
        now = time.monotonic() - started
        early = [p for p in (run / "ckpt").glob("iter_*") if p.name != f"iter_{int(STEPS):07d}"]
        if "saved" not in seen and any((p / "megatron_pacs.json").exists() for p in early):
            seen["saved"] = now
        fields = slurm.job(job)
        restarts = int(fields.get("Restarts", "0"))
        if restarts >= 1:
            if "requeued" not in seen:
                seen["requeued"] = now
                seen["first_rows"] = _metrics(run)
            if fields.get("JobState") in ("RUNNING", *FINISHED):
                seen.setdefault("running again", now)
        if fields.get("JobState") in FINISHED:
            seen.setdefault("finished", now)
            # a job that ended without the requeue: give the batch script's requeue a few seconds to show
            if restarts >= 1 or now - seen["finished"] > 5:
                seen["finished"] = now
                seen["state"] = fields["JobState"]  # type: ignore[assignment]
                return seen
        time.sleep(0.2)
    raise TimeoutError(f"job {job} did not finish in {timeout:.0f}s: {seen}\n{_job_out(run)}\n{slurm.logs()}")


def _stopped_step(run: Path, last: int = int(STEPS)) -> int:
    early = sorted(p for p in (run / "ckpt").glob("iter_*") if p.name != f"iter_{last:07d}")
    assert len(early) == 1, early
    return json.loads((early[0] / "megatron_pacs.json").read_text())["step"]


def _assert_resumed_equal(run: Path, plain: Plain, seen: dict, what: str) -> int:
    out = _job_out(run)
    assert seen.get("state") == "COMPLETED", (seen, out)
    stopped = _stopped_step(run)
    assert 1 <= stopped < int(STEPS), stopped
    assert f"every node stopped cleanly on the exit signal after saving step {stopped}: requeueing" in out, out
    assert out.count("training finished") == 1 and "restart 1): training finished" in out, out
    # The first start's steps up to the stopped one stay in metrics.jsonl (the resumed trainer drops only the rows
    # after its checkpoint), followed by the resumed start's.
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1)), rows
    assert [r for r in rows if r["step"] <= stopped] == [r for r in seen["first_rows"] if r["step"] <= stopped]
    assert rows == _metrics(plain.run)
    a, b = _weights(run, int(STEPS)), _weights(plain.run, int(STEPS))
    assert all(torch.equal(a[k], b[k]) for k in a)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in seen.items() if isinstance(v, float))
    print(f"\n{what}: stopped after step {stopped}; from the signal: {times}")
    return stopped


def test_scancel_signal_term_mid_step_saves_requeues_resumes_and_equals_the_plain_run(
    slurm,
    cluster_setup,  # noqa: F811
    plain,
    tmp_path,
):
    run = tmp_path / "pre"
    job = _submit(slurm, run, **_env(cluster_setup, run))
    deadline = time.monotonic() + 180
    while not _metrics(run) and time.monotonic() < deadline:  # step 1 logged: step 2 is in progress
        assert slurm.job(job).get("JobState") not in FINISHED, _job_out(run)
        time.sleep(0.1)
    assert _metrics(run), _job_out(run)
    slurm.run("scancel", "--signal=TERM", str(job))  # the step processes only, as a preemption's warning
    seen = _follow(slurm, job, run, timeout=240)
    _assert_resumed_equal(run, plain, seen, "preemption (scancel --signal=TERM)")


def test_signal_term_before_the_time_limit_saves_and_requeues(slurm, cluster_setup, tmp_path):  # noqa: F811
    """``--time=3`` with ``--signal=TERM@100`` (grace 8 s + margin 7 s), on one node, in the middle of a run too long
    for the limit, saving every 20 steps: the rank stops after the step in progress, saves it, and the job requeues
    itself (the resume after a requeue is the preemption test's; here the requeued job is cancelled). The periodic
    saves before the signal matter: Slurm's SIGTERM also reached the queue server of Megatron's checkpoint writer,
    started at the first save, and the stop's save failed with a broken pipe (a clean-clone run's failure). Slurm 22.05
    sends the signal N to N + 30 s before the limit when its controller's periodic check runs on time, here 50-80 s
    after the start: after the trainer has started and installed its handler even on a loaded machine (a SIGTERM
    before that fails the run). The 100 s left to the limit absorb a late check. About 60-90 s."""
    run = tmp_path / "limit"
    env = _env(
        cluster_setup,
        run,
        TRAIN_ITERS="2000",
        SAVE_INTERVAL="20",
        EXIT_SIGNAL_GRACE_SECONDS="8",
        SIGNAL_MARGIN_SECONDS="7",
    )
    # one node: the signal's path is the same, at half the CPU of a wait that Slurm's schedule makes long
    job = _submit(slurm, run, "--time=3", "--nodes=1", **env, SBATCH_SIGNAL="TERM@100")
    started = time.monotonic()
    running = None
    while int(slurm.job(job).get("Restarts", "0")) < 1 and time.monotonic() - started < 210:
        fields = slurm.job(job)
        assert fields.get("JobState") not in FINISHED, _job_out(run)
        if running is None and fields.get("JobState") == "RUNNING":
            running = time.monotonic()
        time.sleep(0.2)
    requeued = time.monotonic()
    slurm.run("scancel", str(job))  # pending again: the resume is not this test's
    out = _job_out(run)
    assert running is not None and int(slurm.job(job).get("Restarts", "0")) == 1, out
    assert "exit signal: got SIGTERM; stopping after the step in progress (grace period 8s)" in out, out
    stopped = int((run / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    meta = json.loads((run / "ckpt" / f"iter_{stopped:07d}" / "megatron_pacs.json").read_text())
    assert 20 < stopped < 2000 and len(_metrics(run)) == stopped
    assert meta["parent"] == f"iter_{stopped - 1 - (stopped - 1) % 20:07d}", meta  # a periodic save came first
    assert f"every node stopped cleanly on the exit signal after saving step {stopped}: requeueing" in out, out
    assert "CANCELLED" not in slurm.job(job).get("Reason", "") and "DUE TO TIME LIMIT" not in out, out
    print(
        f"\ntime limit (--time=3, --signal=TERM@100): stopped after step {stopped}; requeued "
        f"{requeued - running:.1f}s after the job started"
    )


def test_a_signal_margin_shorter_than_the_grace_period_is_refused_before_any_node_works(
    slurm,
    cluster_setup,  # noqa: F811
    tmp_path,
):
    run = tmp_path / "short"
    job = _submit(slurm, run, **_env(cluster_setup, run), SBATCH_SIGNAL="TERM@45")
    fields = slurm.wait_state(job, FINISHED, timeout=60)
    out = _job_out(run)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", (fields, out)
    assert "--signal=TERM@45 sends SIGTERM 45s before the time limit" in out, out
    assert "--exit-signal-grace-seconds 60s plus a margin of 30s" in out and "at least 90" in out, out
    assert "training on" not in out and not (run / "logs").exists()
