"""Lost rollout hosts on the shared virtual cluster. A rollout cluster that can come back
(``--rollout-cluster-reconnect-seconds``): its head killed in its namespace mid-run, in both cases in one test (two
trainer launches, the least suite time): the head not back within the window (a clean stop that saves and names
the address and the flag, then a resume once the cluster is back), and back within it (the trainer connects again
and the run completes). Then the asynchronous stream across the hosts, its head lost and back within the window
(the round in flight is repeated after the reconnect). Then a rollout worker host that dies mid-generation: the
fleet regenerates on the survivor. Every step of the synchronous runs equals the continuous run's (per-request
sampling seeds: a regenerated step is the same step).
The worker's loss comes last: it leaves the cluster one host short, and the next test would start a new one (~20 s);
the head's test ends with the cluster whole again.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from cluster_fixtures import *  # noqa: F403 - the fixtures
from cluster_fixtures import same_as_continuous, tails, wait_checkpoint, wait_engines_gone
from deploy import ROLLOUT_HOSTS, TRAIN_HOSTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ADDRESS = "ray://rollout-head:10001"
#: Ray Client's own grace before it reports the lost connection (default 30 s): shortened to save suite time.
GRACE = {"RAY_CLIENT_RECONNECT_GRACE_PERIOD": "5", "SAVE_INTERVAL": "3"}


class _Watch:
    """Records when each pattern first appears in a log after ``offset`` (monotonic time), from a thread."""

    def __init__(self, path, offset: int, patterns: list[str]) -> None:
        self.path, self.offset = path, offset
        self.seen: dict[str, float | None] = dict.fromkeys(patterns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and any(v is None for v in self.seen.values()):
            text = self.path.read_text(errors="replace")[self.offset :] if self.path.exists() else ""
            for p, v in self.seen.items():
                if v is None and p in text:
                    self.seen[p] = time.monotonic()
            time.sleep(0.2)

    def since(self, start: float) -> dict[str, float | None]:
        self._stop.set()
        self._thread.join()
        return {p: None if v is None else round(v - start, 1) for p, v in self.seen.items()}


def _wait_row(d, name: str, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step") == step for r in d.metrics(name)):
            return True
        if any(p.poll() is not None for p in d.trainers.values()):
            return False
        time.sleep(0.3)
    return False


def _wait_text(d, name: str, offset: int, text: str, timeout: float) -> bool:
    """Whether ``text`` appears in rank 0's log after ``offset`` in ``timeout`` (False at once if a trainer exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in _text(d, name, "train0", offset):
            return True
        if any(p.poll() is not None for p in d.trainers.values()):
            return False
        time.sleep(0.2)
    return False


def _kill_rollout_cluster(d) -> float:
    """The head first (killed in its namespace), then the worker (the whole rollout job, as a requeue would)."""
    d.cluster.kill_host("rollout-head")
    killed = time.monotonic()
    d.cluster.kill_host("rollout1")
    return killed


def _offsets(d, name: str) -> dict[str, int]:
    return {h: d.log(f"{name}-{h}").stat().st_size if d.log(f"{name}-{h}").exists() else 0 for h in TRAIN_HOSTS}


def _text(d, name: str, host: str, offset: int) -> str:
    return d.log(f"{name}-{host}").read_text(errors="replace")[offset:]


def test_lost_rollout_head_stops_cleanly_when_not_back_and_reconnects_when_back(deployment, continuous):
    """(b) Both rollout hosts killed once step 1 is logged (the loss is found in step 2's generation or, where that
    was quicker than the kill, in its weight sync), not restarted (window 5 s): every rank saves the last completed
    step (--save-interval 3: not checkpointed yet) and exits non-zero, rank 0 with one line naming the address and
    the flag. (a) The cluster started again, the same command (window 60 s) resumes; the head is killed again once the
    engines are ready (the loss is found in the next engine call: a weight sync or a generation) and restarted within
    the window: the trainer connects again, starts the engines anew, re-syncs and goes on; the run completes, its
    last row counts the reconnect, and steps 1-3 equal the continuous run's."""
    d = deployment
    started = time.monotonic()
    # -- (b) not back within the window ---------------------------------------------------------------------------
    flags = ("--rollout-cluster-reconnect-seconds", "5")
    off = _offsets(d, "reco")
    d.start_trainers("reco", *flags, **GRACE)
    assert _wait_row(d, "reco", 1, 600), _text(d, "reco", "train0", off["train0"])[-6000:]
    watch = _Watch(d.log("reco-train0"), off["train0"], ["fleet: lost the rollout cluster"])
    killed = _kill_rollout_cluster(d)
    codes = d.wait_trainers(timeout=120)
    exited = time.monotonic() - killed
    seen = watch.since(killed)
    logs = {h: _text(d, "reco", h, off[h]) for h in TRAIN_HOSTS}
    assert codes["train0"] not in (0, None) and codes["train1"] not in (0, None), (codes, logs["train0"][-6000:])
    line = f"error: the rollout cluster at {ADDRESS} was lost and did not come back within 5 s"
    assert logs["train0"].count(line) == 1 and "(--rollout-cluster-reconnect-seconds;" in logs["train0"], logs[
        "train0"
    ][-6000:]
    assert "stopped with rank 0, which could not go on" in logs["train1"], logs["train1"][-6000:]
    for h in TRAIN_HOSTS:
        assert "]: Traceback" not in logs[h], logs[h][-6000:]  # no rank failed ([rankN]: Traceback)
    saved = [r["step"] for r in d.metrics("reco")]
    assert saved in ([1], [1, 2]), saved
    assert (d.workdir / "reco-ckpt" / f"iter_{saved[-1]:07d}" / "megatron_pacs.json").exists()  # saved by the stop
    assert not any(d.engine_pids().values())
    print(
        f"reconnect (b): lost found {seen} s after the kill; every rank exited {exited:.1f} s after it; "
        f"step {saved[-1]} saved"
    )

    # -- (a) back within the window ---------------------------------------------------------------------------------
    t0 = time.monotonic()
    d.start_rollout_cluster()
    restarted = time.monotonic() - t0
    flags = ("--rollout-cluster-reconnect-seconds", "60")
    off = _offsets(d, "reco")
    d.start_trainers("reco", *flags, **GRACE)  # the same command: resumes from the step (b) saved
    ready = _wait_text(d, "reco", off["train0"], "engine(s) ready", 600)
    assert ready, _text(d, "reco", "train0", off["train0"])[-6000:]
    patterns = ["fleet: lost the rollout cluster", "fleet: connected to"]
    watch = _Watch(d.log("reco-train0"), off["train0"], patterns)
    killed = _kill_rollout_cluster(d)
    d.start_rollout_cluster()  # the head first: the trainer connects as soon as its client port answers
    back = time.monotonic() - killed
    stepped = _wait_row(d, "reco", 3, 600)
    step3 = time.monotonic() - killed
    codes = d.wait_trainers(timeout=120)
    seen = watch.since(killed)
    logs = {h: _text(d, "reco", h, off[h]) for h in TRAIN_HOSTS}
    assert stepped and codes == {"train0": 0, "train1": 0}, (codes, logs["train0"][-6000:])
    rows = d.metrics("reco")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/cluster_reconnects"] == 1.0, rows[-1]
    same_as_continuous(rows, continuous)
    assert wait_engines_gone(d) == {}
    assert all(p.poll() is None for h in ROLLOUT_HOSTS for p in d.cluster.hosts[h].procs[-1:])
    print(
        f"reconnect (a): cluster restarted in {restarted:.1f} s (between the runs); after the kill: lost found, "
        f"connected again {seen} s, cluster back (both nodes) {back:.1f} s, step 3 logged {step3:.1f} s; "
        f"test {time.monotonic() - started:.1f} s"
    )


def test_the_stream_across_the_hosts_goes_on_when_the_head_is_lost_and_back(deployment):
    """The asynchronous stream (--max-staleness 2 --partial-rollouts, rounds of 4 tokens) on the two training hosts
    against the separate rollout cluster (Ray Client, broadcast sync), its head killed once step 1 is logged and
    started again within the window (60 s): the loss is found by the stream's round beside the trainer (or by a
    weight sync); the fleet connects again, starts the engines anew, re-syncs them from the host copy of the last
    update and repeats the round. The run completes: three steps, no token more than 2 updates old, each prompt
    trained at most once, the last row counting the reconnect."""
    d = deployment
    started = time.monotonic()
    flags = ("--max-staleness", "2", "--partial-rollouts", "--rollout-round-tokens", "4")
    flags += ("--rollout-cluster-reconnect-seconds", "60")
    off = _offsets(d, "strm")
    d.start_trainers("strm", *flags, **GRACE)
    assert _wait_row(d, "strm", 1, 600), _text(d, "strm", "train0", off["train0"])[-6000:]
    watch = _Watch(d.log("strm-train0"), off["train0"], ["fleet: lost the rollout cluster", "fleet: connected to"])
    killed = _kill_rollout_cluster(d)
    d.start_rollout_cluster()
    back = time.monotonic() - killed
    codes = d.wait_trainers(timeout=600)
    seen = watch.since(killed)
    logs = {h: _text(d, "strm", h, off[h]) for h in TRAIN_HOSTS}
    assert codes == {"train0": 0, "train1": 0}, (codes, logs["train0"][-6000:])
    rows = [r for r in d.metrics("strm") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert rows[-1]["rollout/cluster_reconnects"] == 1.0, rows[-1]
    assert all(r["rollout/staleness_token_max"] <= 2 for r in rows), [r["rollout/staleness_token_max"] for r in rows]
    ids = []
    for step in range(1, 4):
        dumped = (d.workdir / "strm" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        ids += list(dict.fromkeys(json.loads(line)["id"] for line in dumped))  # one id per group
    assert len(ids) == 12 and len(set(ids)) == 12, ids
    assert (d.workdir / "strm-ckpt" / "iter_0000003" / "megatron_pacs.json").exists()
    assert wait_engines_gone(d) == {}
    print(
        f"stream, head lost and back: lost found, connected again {seen} s after the kill, cluster back "
        f"{back:.1f} s; staleness max {[r['rollout/staleness_token_max'] for r in rows]}, spanning "
        f"{[round(r['rollout/spanning_responses'], 2) for r in rows]}; test {time.monotonic() - started:.1f} s"
    )
    # the fleet's own account of the reconnect (its connect attempts and the engines' restart), for a slow run
    print("\n".join(line for line in logs["train0"].splitlines() if "fleet: connect" in line))


def test_lost_rollout_host_regenerates_on_the_survivor_and_training_continues(deployment, continuous):
    """Every process on rollout1 (its Ray worker and its engine) SIGKILLed as step 2 starts: the fleet notices at its
    next call to that engine (step 2's generation, whose lost chunks run again, or the weight sync after it, which
    first probes every engine), restarts the engine on the surviving host and re-syncs it; every step then equals
    the continuous run's (per-request sampling seeds: a prompt lost or scored twice would change them)."""
    d = deployment
    d.start_trainers("lostro", "--max-logprob-diff", "1e-5")  # probes every sync, the restarted engine included
    assert wait_checkpoint(d, "lostro", 1, 600), tails(d, "lostro-train0", "lostro-train1")
    killed = time.monotonic()
    d.cluster.kill_host("rollout1")
    recovered = wait_checkpoint(d, "lostro", 2, 600)
    took = time.monotonic() - killed
    codes = d.wait_trainers(timeout=600)
    logs = tails(d, "lostro-train0", "lostro-train1")
    assert recovered and codes == {"train0": 0, "train1": 0}, logs
    rows = [r for r in d.metrics("lostro") if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/engine_failures"] >= 1, rows[-1]
    assert all(r["sync/max_logprob_diff"] <= 1e-5 for r in rows)
    same_as_continuous(rows, continuous)
    print(f"lost rollout host: step 2 checkpointed {took:.1f}s after the kill")
