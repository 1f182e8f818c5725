"""Faults of the training hosts on the virtual cluster: a preempted job (SIGTERM to every training
process), a training host cut off mid-step (found by the heartbeats). Each resumed run is compared with
the uninterrupted one (the ``continuous`` fixture), metric for metric, as tests/test_resume.py does. The rollout
hosts' faults: tests/cluster/test_lost_rollout_hosts.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from cluster_fixtures import *  # noqa: F403 - the fixtures
from cluster_fixtures import same_as_continuous, tails, wait_checkpoint, wait_engines_gone
from deploy import TRAIN_HOSTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


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
        assert all(p.poll() is None for p in d.trainers.values()), tails(d, "pre-train0", "pre-train1")
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
    logs = tails(d, "pre-train0", "pre-train1")
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
    assert codes == {"train0": 0, "train1": 0}, tails(d, "pre-train0", "pre-train1")
    same_as_continuous([r for r in d.metrics("pre") if r.get("step", 0) > stopped], continuous)


def test_lost_training_host_stops_the_survivor_within_the_heartbeat_timeout_and_the_rerun_resumes(
    deployment, continuous
):
    """train1 cut off (its eth0 down: no connection is closed) while rank 0 is held (the engines SIGSTOPped once
    step 1's checkpoint exists: mostly in step 2's generation) and rank 1 waits for it in a collective: train0 exits
    non-zero within --heartbeat-timeout-seconds (the collective timeout is 30 minutes) naming rank 1 and its host,
    with its stacks written, and its engine actors are released; the same command on both hosts resumes from the
    last checkpoint (step 1's, or step 2's when step 2 had generated before the hold) and equals the continuous
    run."""
    d = deployment
    timeout_s = 15
    flags = ("--distributed-timeout-minutes", "30", "--heartbeat-timeout-seconds", str(timeout_s))
    d.start_trainers("lost", *flags)
    assert wait_checkpoint(d, "lost", 1, 600), tails(d, "lost-train0", "lost-train1")
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
    logs = tails(d, "lost-train0")
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

    saved = sorted(int(p.name[5:]) for p in (d.workdir / "lost-ckpt").glob("iter_*"))
    # The engines stop once step 1's checkpoint exists: mostly in step 2's generation, but on an idle host step 2
    # had generated by then (a clean-clone run saved step 2), and train0 then waits for rank 1 in step 2's training
    # or step 3's generation: the rerun resumes from whichever step was saved last.
    resumed_from = saved[-1]
    assert resumed_from in (1, 2), saved
    d.start_trainers("lost", *flags)
    codes = d.wait_trainers(timeout=600)
    assert codes == {"train0": 0, "train1": 0}, tails(d, "lost-train0", "lost-train1")
    same_as_continuous([r for r in d.metrics("lost") if r.get("step", 0) > resumed_from], continuous)
