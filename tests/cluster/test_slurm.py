"""The tiny job under a real Slurm (tests/cluster/slurm.py): ``examples/slurm/tiny.sbatch`` on 2 nodes x 1 rank
(gloo), trained on synthetic rollouts (``ROLLOUT_SOURCE=synthetic``: no Ray cluster). A plain run equals the same
run launched directly; a run preempted with ``scancel --signal=TERM`` saves, requeues itself, resumes and completes
equal to it; one signalled by ``--signal=TERM@N`` before its time limit saves and requeues itself; a too-short
``--signal`` margin is refused before any node works. The heterogeneous job, ``examples/slurm/hetjob.sbatch`` with
the tiny recipe on one node per group (het-group 0 trains, het-group 1 runs the Ray cluster with one vLLM engine on
CPU), runs twice: uninterrupted, and preempted with ``scancel --signal=TERM`` (its Ray cluster stops with the
ranks' signal), saving, requeueing itself, resuming on a new Ray cluster and completing equal to the uninterrupted
one. The five runs are submitted at once and run side by side (Slurm schedules them on 9 nodes), each followed by a
thread, which saves minutes of suite time over one after the other; they start with the session's first cluster
test (tests/conftest.py), so they run while the other cluster tests do. Each fault's times are printed (``-s`` shows
them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cluster_fixtures import *  # noqa: F403 - the fixtures (the Slurm ones too: see slurm_cluster)
from helpers.cpu import PINNED_CPU_ENV
from slurm import SlurmCluster, slurm_unavailable

from megatron_pacs.utils.launch import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "slurm" / "tiny.sbatch"
HETJOB = ROOT / "examples" / "slurm" / "hetjob.sbatch"
#: sbatch's command line for the hetjob: one node per group and no GPUs, over its #SBATCH lines' 8 x 8 GPUs
HET_GROUPS = ("--nodes=1", "--gpus-per-node=0", ":", "--nodes=1", "--gpus-per-node=0")
VENV_BIN = Path(sys.executable).parent
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm")
STEPS = "6"  # the plain and preempted runs: room to signal one mid-run (a tiny step takes ~0.4 s)
NODES = [f"node{i}" for i in range(9)]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Slurm on a controller and 9 node hosts (the plain, preempted and time-limited jobs and the two hetjobs at
    once: 2 + 2 + 1 + 2 + 2); skipped where it cannot run (a failure under ``CI=true``). The session's ``slurm``
    fixture (tests/cluster/cluster_fixtures.py)."""
    why = slurm_unavailable()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the Slurm tests cannot run: {why}")
        pytest.skip(why)
    previous = signal.signal(signal.SIGTERM, _terminated)  # a SIGTERM to pytest still tears the cluster down
    try:
        with SlurmCluster(NODES, tmp_path_factory.mktemp("slurm")) as cluster:
            print(f"\nslurm: controller and {len(NODES)} idle nodes in {cluster.setup_seconds:.1f}s")
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


def _submit(slurm: SlurmCluster, run: Path, *sbatch_args: str, **env: str) -> int:
    run.mkdir(parents=True, exist_ok=True)
    return slurm.sbatch("-o", str(run / "job.out"), *sbatch_args, str(TINY), "--save-hf", cwd=ROOT, **env)


def _job_out(run: Path) -> str:
    """The job's whole output, every start of it (checks read it all: a noisy start can push a line out of a tail)."""
    path = run / "job.out"
    return path.read_text(errors="replace") if path.exists() else "(no job output)"


def _tail(text: str) -> str:
    """What a failed check shows of a job's output: its last 8,000 characters."""
    return text[-8000:]


def _poll(ready: Callable[[], bool], timeout: float, what: str, every: float = 0.25) -> float:
    """Wait (bounded, ended early by :data:`_STOP`) until ``ready()``; returns when it became true (monotonic)."""
    deadline = time.monotonic() + timeout
    while not _STOP.is_set() and time.monotonic() < deadline:
        if ready():
            return time.monotonic()
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s" + (" (the module is ending)" if _STOP.is_set() else ""))


#: Set when the module's jobs fixture ends: every scenario thread's wait gives up.
_STOP = threading.Event()


@dataclass
class Plain:
    """The plain sbatch run and the same run launched directly."""

    run: Path
    direct: Path
    seconds: float


def _plain(slurm: SlurmCluster, setup: Path, root: Path) -> Plain:
    """``sbatch tiny.sbatch`` to completion and, at the same time, the same job launched directly: 2 local ranks
    through ``python -m megatron_pacs.torchrun`` (examples/tiny_cluster.sh with NNODES=1, GPUS_PER_NODE=2)."""
    run, direct = root / "sbatch", root / "direct"
    started = time.monotonic()
    job = _submit(slurm, run, **_env(setup, run))
    env = dict(os.environ, **_env(setup, direct), NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()))
    env.pop("GLOO_SOCKET_IFNAME")
    direct.mkdir()
    with open(direct / "out.log", "wb") as out:
        proc = subprocess.run(
            ["bash", "examples/tiny_cluster.sh", "--save-hf"], env=env, cwd=ROOT, stdout=out, stderr=out, timeout=300
        )
    assert proc.returncode == 0, (direct / "out.log").read_text(errors="replace")[-6000:]
    fields = slurm.wait_state(job, FINISHED, timeout=240)
    seconds = time.monotonic() - started
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", (fields, _tail(_job_out(run)))
    return Plain(run, direct, seconds)


def _follow(slurm: SlurmCluster, job: int, run: Path, timeout: float) -> dict:
    """Seconds from now to: a checkpoint before the last step (the graceful save), the job requeued, running again,
    and finished; polls until the job finishes (bounded) and returns what it saw, with the metrics rows the first
    start had logged when the job was requeued (``first_rows``)."""
    started, seen = time.monotonic(), {}

    def finished() -> bool:
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
        if fields.get("JobState") not in FINISHED:
            return False
        seen.setdefault("finished", now)
        # a job that ended without the requeue: give the batch script's requeue a few seconds to show
        if restarts >= 1 or now - seen["finished"] > 5:
            seen["finished"], seen["state"] = now, fields["JobState"]
            return True
        return False

    try:
        _poll(finished, timeout, f"job {job} finished", every=0.5)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: {seen}\n{_tail(_job_out(run))}\n{slurm.logs()}") from None
    return seen


def _preempted(slurm: SlurmCluster, setup: Path, run: Path) -> dict:
    """``scancel --signal=TERM`` (the step processes only, as a preemption's warning) once step 1 is logged, with
    step 2 in progress; what :func:`_follow` saw from then on."""
    job = _submit(slurm, run, **_env(setup, run))

    def step_1_logged() -> bool:
        assert not (run / "job.out").exists() or "training finished" not in _job_out(run), _tail(_job_out(run))
        return bool(_metrics(run))

    _poll(step_1_logged, 300, "step 1 of the job to preempt", every=0.1)
    slurm.run("scancel", "--signal=TERM", str(job))
    return _follow(slurm, job, run, timeout=300)


def _run_time(fields: dict[str, str]) -> int:
    """``scontrol show job``'s RunTime (``[D-]HH:MM:SS``) in seconds."""
    days, _, hms = fields["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _time_limited(slurm: SlurmCluster, setup: Path, run: Path) -> dict:
    """A run too long for its limit, one node, saving every 20 steps, with ``--signal=TERM@100`` (grace 8 s + margin
    7 s): submitted with ``--time=10``; once its first periodic save is complete, ``scontrol update TimeLimit``
    shortens the limit to leave it 70-130 s, within the N + 30 s of Slurm's next time-limit check (every 30 s), so
    the warning comes within 30 s rather than minutes into the run. The requeued job is cancelled (the resume after
    a requeue is the preemption test's). The periodic save before the signal matters: Slurm's SIGTERM also reached
    the queue server of Megatron's checkpoint writer, started at the first save, and the stop's save failed with a
    broken pipe (a clean-clone run's failure)."""
    env = dict(TRAIN_ITERS="2000", SAVE_INTERVAL="20", EXIT_SIGNAL_GRACE_SECONDS="8", SIGNAL_MARGIN_SECONDS="7")
    job = _submit(slurm, run, "--time=10", "--nodes=1", **_env(setup, run, **env), SBATCH_SIGNAL="TERM@100")
    first_save = run / "ckpt" / "iter_0000020" / "megatron_pacs.json"

    def saved() -> bool:
        assert slurm.job(job).get("JobState") not in FINISHED, _tail(_job_out(run))
        return first_save.exists()

    _poll(saved, 300, "the time-limited job's first periodic save", every=0.5)
    elapsed = _run_time(slurm.job(job))
    limit = (elapsed + 130) // 60
    slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={limit}")
    shortened = time.monotonic()
    requeued = _poll(lambda: int(slurm.job(job).get("Restarts", "0")) >= 1, 120, "the requeue", every=0.5)
    slurm.run("scancel", str(job))  # pending again: the resume is not this test's
    return {"job": job, "elapsed": elapsed, "limit": limit, "requeued": requeued - shortened}


def _het_env(setup: Path, run: Path, ray_tmp: Path) -> dict[str, str]:
    """The hetjob's environment: the tiny recipe against the Ray cluster of het-group 1 (one vLLM engine on CPU,
    its Ray node in a short temporary folder of its own: Ray's socket paths are limited to 107 bytes), as in
    docs/cluster.md's hand run. Ray Client's reconnect grace is cut to 5 s: a generation in flight when the signal
    stops the Ray cluster fails after it, and the trainer then saves the last update (docs/cluster.md, "Slurm")."""
    ray_args = f"--num-cpus 2 --include-dashboard=false --temp-dir {ray_tmp} --object-store-memory {2**28}"
    return _env(
        setup,
        run,
        ROLLOUT_SOURCE="fleet",
        RECIPE="examples/tiny_cluster.sh",
        NUM_ENGINES="1",
        NUM_GPUS="0",
        RAY_START_ARGS=ray_args,
        RAY_AUTH_TOKEN_PATH=str(run / "ray_auth_token"),
        RAY_CLIENT_RECONNECT_GRACE_PERIOD="5",
    )


def _het_submit(slurm: SlurmCluster, setup: Path, run: Path, ray_tmp: Path) -> int:
    run.mkdir(parents=True, exist_ok=True)
    out = ("-o", str(run / "job.out"))
    env = _het_env(setup, run, ray_tmp)
    return slurm.sbatch(*out, *HET_GROUPS, str(HETJOB), "--save-hf", *slurm.forked_engines(**env), cwd=ROOT, **env)


def _het_plain(slurm: SlurmCluster, setup: Path, run: Path, ray_tmp: Path) -> float:
    """``sbatch hetjob.sbatch`` to completion, uninterrupted (the preempted hetjob's twin); its seconds."""
    started = time.monotonic()
    job = _het_submit(slurm, setup, run, ray_tmp)
    fields = slurm.wait_state(job, FINISHED, timeout=540)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", (fields, _tail(_job_out(run)))
    return time.monotonic() - started


def _het_preempted(slurm: SlurmCluster, setup: Path, run: Path, ray_tmp: Path) -> dict:
    """The hetjob, ``scancel --signal=TERM`` to the whole job (both groups' steps: the ranks and the Ray cluster)
    once step 1 is logged; what :func:`_follow` saw from then on."""
    job = _het_submit(slurm, setup, run, ray_tmp)

    def step_1_logged() -> bool:
        assert slurm.job(job).get("JobState") not in FINISHED, _tail(_job_out(run))
        return bool(_metrics(run))

    _poll(step_1_logged, 420, "step 1 of the hetjob to preempt", every=0.1)
    slurm.run("scancel", "--signal=TERM", str(job))
    return _follow(slurm, job, run, timeout=480)


@dataclass
class Jobs:
    """The scenarios' folders (``root / "plain"``, ``"pre"``, ``"limit"``, ``"het"``, ``"het-pre"``) and their
    threads' results."""

    root: Path
    futures: dict[str, Future]

    def result(self, name: str) -> Any:
        return self.futures[name].result(timeout=600)


def slurm_jobs(slurm: SlurmCluster, cluster_setup: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """The plain run (and its direct launch), the preempted run, the time-limited run and the two hetjobs, submitted
    at once: Slurm runs them side by side on the 9 nodes (2 + 2 + 1 + 2 + 2), each followed by its own thread; the
    tests check them. The hetjobs' Ray nodes keep their sockets in short temporary folders, removed at the end. The
    session's ``jobs`` fixture (tests/cluster/cluster_fixtures.py), started with the first cluster test."""
    root = tmp_path_factory.mktemp("jobs")
    ray_tmp = Path(tempfile.mkdtemp(prefix="mph", dir="/tmp"))
    _STOP.clear()
    pool = ThreadPoolExecutor(5, thread_name_prefix="slurm-job")
    try:
        futures = {
            # the hetjobs first: their Ray cluster and engine start take longest
            "het_preempted": pool.submit(_het_preempted, slurm, cluster_setup, root / "het-pre", ray_tmp / "p"),
            "het_plain": pool.submit(_het_plain, slurm, cluster_setup, root / "het", ray_tmp / "u"),
            "time_limited": pool.submit(_time_limited, slurm, cluster_setup, root / "limit"),
            "preempted": pool.submit(_preempted, slurm, cluster_setup, root / "pre"),
            "plain": pool.submit(_plain, slurm, cluster_setup, root / "plain"),
        }
        yield Jobs(root, futures)
    finally:
        _STOP.set()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_sbatch_runs_the_tiny_job_to_completion_equal_to_the_direct_launch(jobs):
    plain = jobs.result("plain")
    print(f"\nplain run: sbatch to COMPLETED in {plain.seconds:.1f}s (the direct run alongside)")
    rows = _metrics(plain.run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1))
    assert rows == _metrics(plain.direct)
    a, b = _weights(plain.run, int(STEPS)), _weights(plain.direct, int(STEPS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = _job_out(plain.run)
    assert "training finished" in out and "requeueing" not in out, _tail(out)
    assert not list((plain.run / "stops").glob("*.json"))


def _stopped_step(run: Path, last: int = int(STEPS)) -> int:
    early = sorted(p for p in (run / "ckpt").glob("iter_*") if p.name != f"iter_{last:07d}")
    assert len(early) == 1, early
    return json.loads((early[0] / "megatron_pacs.json").read_text())["step"]


def test_scancel_signal_term_mid_step_saves_requeues_resumes_and_equals_the_plain_run(jobs):
    seen, plain, run = jobs.result("preempted"), jobs.result("plain"), jobs.root / "pre"
    out = _job_out(run)
    assert seen.get("state") == "COMPLETED", (seen, _tail(out))
    stopped = _stopped_step(run)
    assert 1 <= stopped < int(STEPS), stopped
    assert f"every node stopped cleanly on the exit signal after saving step {stopped}: requeueing" in out, _tail(out)
    assert out.count("training finished") == 1 and "restart 1): training finished" in out, _tail(out)
    # The first start's steps up to the stopped one stay in metrics.jsonl (the resumed trainer drops only the rows
    # after its checkpoint), followed by the resumed start's.
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1)), rows
    assert [r for r in rows if r["step"] <= stopped] == [r for r in seen["first_rows"] if r["step"] <= stopped]
    assert rows == _metrics(plain.run)
    a, b = _weights(run, int(STEPS)), _weights(plain.run, int(STEPS))
    assert all(torch.equal(a[k], b[k]) for k in a)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in seen.items() if isinstance(v, float))
    print(f"\npreemption (scancel --signal=TERM): stopped after step {stopped}; from the signal: {times}")


def test_signal_term_before_the_time_limit_saves_and_requeues(slurm, jobs):
    """The time-limited run (:func:`_time_limited`): Slurm's warning before the limit stops the rank after the step
    in progress, it saves that step, and the job requeues itself, not killed at the limit."""
    limited, run = jobs.result("time_limited"), jobs.root / "limit"
    job = limited["job"]
    out = _job_out(run)
    assert int(slurm.job(job).get("Restarts", "0")) == 1, _tail(out)
    assert "exit signal: got SIGTERM; stopping after the step in progress (grace period 8s)" in out, _tail(out)
    stopped = int((run / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    meta = json.loads((run / "ckpt" / f"iter_{stopped:07d}" / "megatron_pacs.json").read_text())
    assert 20 < stopped < 2000 and len(_metrics(run)) == stopped
    assert meta["parent"] == f"iter_{stopped - 1 - (stopped - 1) % 20:07d}", meta  # a periodic save came first
    assert f"every node stopped cleanly on the exit signal after saving step {stopped}: requeueing" in out, _tail(out)
    assert "CANCELLED" not in slurm.job(job).get("Reason", "") and "DUE TO TIME LIMIT" not in out, _tail(out)
    print(
        f"\ntime limit (--signal=TERM@100; --time=10, then {limited['limit']} min at {limited['elapsed']} s): "
        f"stopped after step {stopped}; requeued {limited['requeued']:.1f}s after the limit was shortened"
    )


def test_a_signal_margin_shorter_than_the_grace_period_is_refused_before_any_node_works(
    slurm,
    cluster_setup,
    tmp_path,
):
    run = tmp_path / "short"
    job = _submit(slurm, run, **_env(cluster_setup, run), SBATCH_SIGNAL="TERM@45")
    fields = slurm.wait_state(job, FINISHED, timeout=60)
    out = _job_out(run)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", (fields, out)
    assert "--signal=TERM@45 sends SIGTERM 45s before the time limit" in out, _tail(out)
    assert "--exit-signal-grace-seconds 60s plus a margin of 30s" in out and "at least 90" in out, _tail(out)
    assert "training on" not in out and not (run / "logs").exists()


def test_hetjob_runs_the_tiny_recipe_against_its_own_ray_cluster_to_completion(jobs):
    """The uninterrupted hetjob: het-group 1's Ray head came up, the trainer on het-group 0 reached it through
    ``RAY_ADDRESS=ray://<head>:10001``, its engine generated every step, and the job ended COMPLETED."""
    seconds, run = jobs.result("het_plain"), jobs.root / "het"
    out = _job_out(run)
    print(f"\nhetjob: sbatch to COMPLETED in {seconds:.1f}s")
    assert out.count("rollout cluster up: RAY_ADDRESS=ray://node") == 1, _tail(out)
    assert "training finished" in out and "requeueing" not in out, _tail(out)
    assert "fleet: 1 engine(s) ready" in out, _tail(out)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1)), _tail(out)
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows), rows


def test_hetjob_scancel_signal_term_saves_requeues_resumes_on_a_new_ray_cluster_and_equals_the_uninterrupted_run(
    jobs,
):
    """``scancel --signal=TERM`` reaches both groups' steps: the ranks latch it, and the Ray cluster stops under
    them. The rank saves the last step whose update its weights hold (the step in progress when it could finish it,
    else the one before: a generation in flight fails once Ray Client's grace has passed) and stops cleanly; the job
    requeues itself, starts a new Ray cluster and engine, resumes from SAVE_DIR and completes with every step's
    metrics and the final weights bit-equal to the uninterrupted hetjob's (vLLM's sampling is seeded per request, and
    the engine gets the trainer's weights at every step, so a new engine generates the same rollouts)."""
    seen, run = jobs.result("het_preempted"), jobs.root / "het-pre"
    jobs.result("het_plain")
    out = _job_out(run)
    assert seen.get("state") == "COMPLETED", (seen, _tail(out))
    stopped = _stopped_step(run)
    assert 1 <= stopped < int(STEPS), stopped
    assert f"every node stopped cleanly on the exit signal after saving step {stopped}: requeueing" in out, _tail(out)
    assert out.count("rollout cluster up: RAY_ADDRESS=ray://node") == 2, _tail(out)  # one Ray cluster per start
    assert out.count("training finished") == 1 and "restart 1): training finished" in out, _tail(out)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, int(STEPS) + 1)), rows
    assert [r for r in rows if r["step"] <= stopped] == [r for r in seen["first_rows"] if r["step"] <= stopped]
    assert rows == _metrics(jobs.root / "het")
    a, b = _weights(run, int(STEPS)), _weights(jobs.root / "het", int(STEPS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    how = "the rollout side failed" if "exit signal: the rollout side failed after it" in out else "a step boundary"
    times = ", ".join(f"{k} {v:.1f}s" for k, v in seen.items() if isinstance(v, float))
    print(f"\nhetjob preemption (scancel --signal=TERM): stopped after step {stopped} ({how}); since: {times}")
