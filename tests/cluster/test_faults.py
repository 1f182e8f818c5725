"""Faults across hosts on the virtual cluster (issue 19): a preempted job (SIGTERM to every training process), a
training host cut off mid-step (found by the heartbeats, issue 30.4), a rollout host that dies mid-generation.
Each resumed or continued run is compared with the uninterrupted one (the ``continuous`` fixture), metric for
metric, as tests/test_resume.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from cluster_fixtures import *  # noqa: F403 - the fixtures
from cluster_fixtures import wait_engines_gone
from deploy import TRAIN_HOSTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm")


def _wait_checkpoint(d, name: str, step: int, timeout: float) -> bool:
    """Whether ``name``'s checkpoint of ``step`` is complete within ``timeout`` (False early when a trainer ends)."""
    meta = d.workdir / f"{name}-ckpt" / f"iter_{step:07d}" / "megatron_pacs.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if meta.exists():
            return True
        if any(p.poll() is not None for p in d.trainers.values()):
            return False
        time.sleep(0.5)
    return False


def _same_as_continuous(rows: list[dict], continuous) -> None:
    by_step = {r["step"]: r for r in continuous.rows}
    assert rows, "the resumed run logged no step"
    for r in rows:
        assert {k: r[k] for k in KEYS} == {k: by_step[r["step"]][k] for k in KEYS}, r["step"]


def _logs(d, *names: str) -> str:
    return "\n".join(d.tail(n, 6000) for n in names)


def test_preemption_stops_every_rank_at_a_step_boundary_saves_exits_0_and_resumes(deployment, continuous):
    """SIGTERM to every process on both training hosts (as Slurm sends before it kills) during step 2, with
    checkpoints only at the end (--save-interval 3): every rank stops after the same step, saves it, exits 0 within
    the grace period, the engines are released; the same command then resumes and matches the continuous run. The
    engines are held (SIGSTOP) while the signal goes out, so that it lands before step 3: on an idle machine a tiny
    step takes 0.35 s, and a run once finished step 2 between the poll that saw step 1 and the signal."""
    d = deployment
    d.start_trainers("pre", SAVE_INTERVAL="3")
    # Step 1 logged (no checkpoint before the end with --save-interval 3): preempt during step 2.
    deadline = time.monotonic() + 600
    while not any(r.get("step") == 1 for r in d.metrics("pre")) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in d.trainers.values()), _logs(d, "pre-train0", "pre-train1")
        time.sleep(0.1)
    engines = [pid for pids in d.engine_pids().values() for pid in pids]
    assert engines, d.engine_pids()
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        sent = time.monotonic()
        for host in TRAIN_HOSTS:
            d.cluster.signal_host(host, signal.SIGTERM)
    finally:
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    codes = d.wait_trainers(timeout=90)
    took = time.monotonic() - sent
    logs = _logs(d, "pre-train0", "pre-train1")
    # torch elastic's agent exits 1 on SIGTERM whatever its ranks do; the recipes' launcher (megatron_pacs.torchrun)
    # exits 0 once every local rank reported a clean stop
    assert set(codes.values()) == {0}, (codes, logs)
    assert took < 60, f"exited {took:.0f}s after SIGTERM (grace period 60s)"
    assert all(not d.cluster.pids(h) for h in TRAIN_HOSTS), d.cluster.leftovers()
    stopped = max(r["step"] for r in d.metrics("pre"))
    for host in TRAIN_HOSTS:
        text = d.log(f"pre-{host}").read_text(errors="replace")
        assert f"exit signal: stopped after step {stopped} " in text and "exiting 0" in text, text[-6000:]
        assert "]: Traceback" not in text, text[-6000:]  # no rank failed ([rankN]: Traceback)
    assert stopped < 3
    print(f"preemption: every process gone {took:.1f}s after SIGTERM (stopped after step {stopped})")
    meta = json.loads((d.workdir / "pre-ckpt" / f"iter_{stopped:07d}" / "megatron_pacs.json").read_text())
    assert meta["step"] == stopped
    assert not list((d.workdir / "pre-ckpt").glob(".iter_*.tmp-*"))
    assert wait_engines_gone(d) == {}

    d.start_trainers("pre", SAVE_INTERVAL="3")  # the same command: resumes from the step it stopped at
    codes = d.wait_trainers(timeout=600)
    assert codes == {"train0": 0, "train1": 0}, _logs(d, "pre-train0", "pre-train1")
    _same_as_continuous([r for r in d.metrics("pre") if r.get("step", 0) > stopped], continuous)


def test_lost_training_host_stops_the_survivor_within_the_heartbeat_timeout_and_the_rerun_resumes(
    deployment, continuous
):
    """train1 cut off (its eth0 down: no connection is closed) while rank 0 is held in step 2's generation (the
    engines SIGSTOPped) and rank 1 waits for it in a collective: train0 exits non-zero within
    --heartbeat-timeout-seconds (the collective timeout is 30 minutes) naming rank 1 and its host, with its stacks
    written, and its engine actors are released; the same command on both hosts resumes from the step-1 checkpoint
    and equals the continuous run."""
    d = deployment
    timeout_s = 15
    flags = ("--distributed-timeout-minutes", "30", "--heartbeat-timeout-seconds", str(timeout_s))
    d.start_trainers("lost", *flags)
    assert _wait_checkpoint(d, "lost", 1, 600), _logs(d, "lost-train0", "lost-train1")
    engines = [pid for pids in d.engine_pids().values() for pid in pids]
    assert engines, d.engine_pids()
    for pid in engines:  # step 2's generation never ends
        os.kill(pid, signal.SIGSTOP)
    try:
        d.cluster.set_link("train1", up=False)
        cut = time.monotonic()
        try:
            code = d.trainers["train0"].wait(timeout=timeout_s + 60)
        except Exception:  # noqa: BLE001 - reported below
            code = None
        took = time.monotonic() - cut
    finally:
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        d.cluster.set_link("train1", up=True)
    logs = _logs(d, "lost-train0")
    assert code not in (0, None), logs
    print(f"lost training host (links down): train0 exited {took:.1f}s after the cut (timeout {timeout_s}s)")
    assert took <= timeout_s + 2, f"train0 exited {took:.1f}s after the cut"  # + a loaded machine
    address = d.cluster.hosts["train1"].address
    assert f"lost training rank 1 (host {address})" in logs, logs
    (dump,) = (d.workdir / "lost" / "stacks").glob("rank0-*.txt")
    assert "lost training rank 1" in dump.read_text().splitlines()[0]
    assert wait_engines_gone(d) == {}  # killed by train0 before its exit (not Ray Client's 30 s grace later)
    print(f"lost training host: engines released {time.monotonic() - cut:.1f}s after the cut")
    d.cluster.kill_host("train1")  # cut off from the store, its ranks end on their own; its agent may not

    resumed_from = max(int(p.name[5:]) for p in (d.workdir / "lost-ckpt").glob("iter_*"))
    assert resumed_from == 1
    d.start_trainers("lost", *flags)
    codes = d.wait_trainers(timeout=600)
    assert codes == {"train0": 0, "train1": 0}, _logs(d, "lost-train0", "lost-train1")
    _same_as_continuous([r for r in d.metrics("lost") if r.get("step", 0) > resumed_from], continuous)


def test_lost_rollout_host_regenerates_on_the_survivor_and_training_continues(deployment, continuous):
    """Every process on rollout1 (its Ray worker and its engine) SIGKILLed as step 2 starts: the fleet notices at its
    next call to that engine (step 2's generation, whose lost chunks run again, or the weight sync after it, which
    first probes every engine), restarts the engine on the surviving host and re-syncs it; every step then equals
    the continuous run's (per-request sampling seeds: a prompt lost or scored twice would change them)."""
    d = deployment
    d.start_trainers("lostro", "--max-logprob-diff", "1e-5")  # probes every sync, the restarted engine included
    assert _wait_checkpoint(d, "lostro", 1, 600), _logs(d, "lostro-train0", "lostro-train1")
    killed = time.monotonic()
    d.cluster.kill_host("rollout1")
    recovered = _wait_checkpoint(d, "lostro", 2, 600)
    took = time.monotonic() - killed
    codes = d.wait_trainers(timeout=600)
    logs = _logs(d, "lostro-train0", "lostro-train1")
    assert recovered and codes == {"train0": 0, "train1": 0}, logs
    rows = [r for r in d.metrics("lostro") if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/engine_failures"] >= 1, rows[-1]
    assert all(r["sync/max_logprob_diff"] <= 1e-5 for r in rows)
    _same_as_continuous(rows, continuous)
    print(f"lost rollout host: step 2 checkpointed {took:.1f}s after the kill")
