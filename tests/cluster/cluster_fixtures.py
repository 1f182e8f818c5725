"""Fixtures of the virtual-cluster tests: the skip (a failure under ``CI=true``), the tiny model and data, and one
virtual cluster shared by the tests, always torn down (test failure, timeout, Ctrl-C or SIGTERM to pytest). Test
modules import them (no conftest.py here: the suite's one conftest.py is tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from deploy import HOSTS, ROLLOUT_HOSTS, TRAIN_HOSTS, Deployment
from netns import VirtualCluster, namespaces_unavailable

__all__ = [
    "Run",
    "cluster_setup",
    "continuous",
    "deployment",
    "jobs",
    "netns_ok",
    "shared_cluster",
    "slurm",
    "wait_engines_gone",
]


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip where network namespaces cannot be made; under CI (``CI=true``) that is a failure instead."""
    why = namespaces_unavailable()
    if why is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the virtual-cluster tests cannot run: {why}")
    pytest.skip(f"virtual cluster unavailable: {why}")


#: One setup, one continuous run and one shared cluster at a time per session: test modules import these fixtures,
#: and pytest would otherwise make a session fixture once per importing module.
_SESSION: dict[str, object] = {}


@pytest.fixture(scope="session")
def cluster_setup(tmp_path_factory) -> Path:
    """The tiny Qwen2 and its ``train.jsonl`` (``helpers.runs.make_rl_setup``), on the shared filesystem."""
    from helpers.runs import make_rl_setup

    if "setup" not in _SESSION:
        _SESSION["setup"] = make_rl_setup(tmp_path_factory.mktemp("cluster_setup"), tied=False, num_problems=32)
    return cast(Path, _SESSION["setup"])


def _once(name: str, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """A session fixture's value made once per session (each importing module has a fixture of its own): the first
    to ask starts ``start()``'s generator and finishes it at its own tear-down; the others get the same value."""
    if name in _SESSION:
        yield _SESSION[name]
        return
    made = start()
    _SESSION[name] = next(made)
    try:
        yield _SESSION[name]
    finally:
        del _SESSION[name]
        with contextlib.suppress(StopIteration):
            next(made)


@pytest.fixture(scope="session")
def slurm(netns_ok, tmp_path_factory):
    """tests/cluster/test_slurm.py's Slurm cluster (``slurm_cluster``), for the session: its jobs start with the
    session's first cluster test (tests/conftest.py), while the other cluster tests run."""
    import test_slurm  # collected already: the fixture is asked for only where its tests are selected

    yield from _once("slurm", lambda: test_slurm.slurm_cluster(tmp_path_factory))


@pytest.fixture(scope="session")
def jobs(slurm, cluster_setup, tmp_path_factory):
    """tests/cluster/test_slurm.py's five Slurm jobs (``slurm_jobs``), submitted once per session."""
    import test_slurm

    yield from _once("jobs", lambda: test_slurm.slurm_jobs(slurm, cluster_setup, tmp_path_factory))


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(f"pytest got signal {signum}")


@contextlib.contextmanager
def virtual_deployment(setup: Path, workdir: Path) -> Iterator[Deployment]:
    """A fresh 2 + 2 host virtual cluster (no processes yet) with its :class:`Deployment`; always torn down, and
    checked to leave no namespace behind."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # Ctrl-C already raises KeyboardInterrupt
    cluster = VirtualCluster(HOSTS, workdir)
    deployment = Deployment(cluster, workdir, setup)
    try:
        yield deployment
    finally:
        try:
            cluster.close()
            shutil.rmtree(deployment.ray_tmp, ignore_errors=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert not cluster.exists(), "the virtual cluster's namespaces or bridge are left behind"


# -- the shared cluster -------------------------------------------------------------------------------------------
# Every test runs its own trainers (their own job, checkpoints and logs under their own name) on one virtual cluster
# whose Ray rollout cluster is started once: starting it costs about 20 s, and no test but the lost rollout host's
# changes it. A test that leaves it unfit (a rollout host's Ray gone, or engines not released) ends it, and the next
# test gets a fresh one.


def _shared(setup: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """The session's shared deployment, its rollout cluster started (made on first use, and again after a discard)."""
    if "stopping" in _SESSION:  # a test after the last expected one (another order): the old one ends first
        discard_shared()
    if "shared" not in _SESSION:
        stack = contextlib.ExitStack()
        d = stack.enter_context(virtual_deployment(setup, tmp_path_factory.mktemp("cluster")))
        _SESSION["shared"] = (stack, d)
        try:
            d.start_rollout_cluster()
        except BaseException:
            discard_shared()
            raise
    return cast(tuple[contextlib.ExitStack, Deployment], _SESSION["shared"])[1]


def discard_shared(graceful: bool = False) -> dict[str, list[int]]:
    """End the shared cluster and delete its namespaces. ``graceful``: first stop the rollout hosts as an operator
    would (SIGTERM to ``ray_cluster.sh``, then SIGKILL); returns what was still running anywhere after that stop."""
    stopping = cast("threading.Thread | None", _SESSION.pop("stopping", None))
    if stopping is not None:
        stopping.join()
    entry = _SESSION.pop("shared", None)
    if entry is None:
        return {}
    stack, d = cast(tuple[contextlib.ExitStack, Deployment], entry)
    with stack:
        if stopping is not None:
            return cast(dict[str, list[int]], _SESSION.pop("leftovers", {})) if graceful else {}
        if not graceful:
            return {}
        _stop_rollout_hosts(d)
        return cast(dict[str, list[int]], _SESSION.pop("leftovers"))


def _stop_rollout_hosts(d: Deployment) -> None:
    for host in ROLLOUT_HOSTS:
        d.cluster.stop_host(host)
    _SESSION["leftovers"] = d.cluster.leftovers()


def stop_shared_in_background() -> None:
    """Begin the graceful stop of the shared rollout hosts in a thread (about 40 s, mostly waiting for Ray's
    processes to exit), called after the last test that uses the cluster: the tests after it run meanwhile, and its
    idle Ray nodes no longer take CPU for the rest of the session. The namespaces go, and the stop's leftovers are
    checked, in :func:`discard_shared` (main thread: it restores pytest's SIGTERM handler)."""
    entry = _SESSION.get("shared")
    if entry is None or "stopping" in _SESSION:
        return
    d = cast(tuple[contextlib.ExitStack, Deployment], entry)[1]
    _SESSION["stopping"] = thread = threading.Thread(target=_stop_rollout_hosts, args=(d,), name="stop-shared-cluster")
    thread.start()


def _fit(d: Deployment) -> bool:
    """Whether the rollout cluster can serve the next test: both Ray nodes' processes alive, no engine left."""
    alive = all(p.poll() is None for h in ROLLOUT_HOSTS for p in d.cluster.hosts[h].procs[-1:])
    return alive and not wait_engines_gone(d, timeout=60)


@pytest.fixture(scope="session")
def shared_cluster(netns_ok) -> Iterator[None]:
    """Ends the shared cluster with the session (also after a failure), checking that the stop leaves nothing."""
    yield
    leftovers = discard_shared(graceful=True)
    assert leftovers == {}, f"processes left after the rollout hosts were stopped: {leftovers}"


@pytest.fixture
def deployment(shared_cluster, cluster_setup, tmp_path_factory) -> Iterator[Deployment]:
    """The shared cluster for one test; afterwards the test's trainers are ended (if still running) and the cluster
    is discarded when the test left it unfit."""
    d = _shared(cluster_setup, tmp_path_factory)
    if not _fit(d):  # e.g. the continuous run's engines are still there
        discard_shared()
        d = _shared(cluster_setup, tmp_path_factory)
    yield d
    for host in TRAIN_HOSTS:
        d.cluster.stop_host(host)
    if not _fit(d):
        discard_shared()


@dataclass
class Run:
    """What a finished deployment left: exit codes, metrics rows (steps >= 1), the hosts' logs, and what was still
    running on the rollout hosts (engines) and the training hosts (anything) after the trainers ended."""

    codes: dict[str, int | None]
    rows: list[dict]
    logs: str
    workdir: Path
    train0_address: str
    engines_left: dict[str, list[int]]
    leftovers: dict[str, list[int]]
    seconds: float


#: The per-step metrics a resumed or recovered run must share with the continuous one.
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm")


def wait_checkpoint(d: Deployment, name: str, step: int, timeout: float) -> bool:
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


def same_as_continuous(rows: list[dict], continuous: Run) -> None:
    """Every row's :data:`KEYS` equal the continuous run's at the same step."""
    by_step = {r["step"]: r for r in continuous.rows}
    assert rows, "the resumed run logged no step"
    for r in rows:
        assert {k: r[k] for k in KEYS} == {k: by_step[r["step"]][k] for k in KEYS}, r["step"]


def tails(d: Deployment, *names: str) -> str:
    """The last 6000 characters of each named log."""
    return "\n".join(d.tail(n, 6000) for n in names)


def wait_engines_gone(d: Deployment, timeout: float = 90.0) -> dict[str, list[int]]:
    """Engine actor processes still alive on the rollout hosts after ``timeout`` (bounded poll)."""
    deadline = time.monotonic() + timeout
    while (left := {h: p for h, p in d.engine_pids().items() if p}) and time.monotonic() < deadline:
        time.sleep(1)
    return left


@pytest.fixture(scope="session")
def continuous(shared_cluster, cluster_setup, tmp_path_factory) -> Run:
    """The documented deployment's 3 steps, uninterrupted (the reference of the fault tests), on the shared cluster."""
    if "continuous" not in _SESSION:
        _SESSION["continuous"] = _run_continuous(_shared(cluster_setup, tmp_path_factory))
    return cast(Run, _SESSION["continuous"])


def _run_continuous(d: Deployment) -> Run:
    started = time.monotonic()
    d.start_trainers("run", "--max-logprob-diff", "1e-5")  # every sync probed; stops the run above the bound
    codes = d.wait_trainers(timeout=600)
    engines_left = wait_engines_gone(d)
    leftovers = {h: pids for h in TRAIN_HOSTS if (pids := d.cluster.pids(h))}
    for host in TRAIN_HOSTS:  # whatever a failed run left
        d.cluster.stop_host(host)
    # this run's and the rollout hosts' logs only (the shared workdir also holds the fault tests' runs)
    names = {d.log(n).name for n in ("run-train0", "run-train1", *ROLLOUT_HOSTS)}
    logs = "".join(p.read_text(errors="replace") for p in sorted((d.workdir / "logs").glob("*.log")) if p.name in names)
    rows = [r for r in d.metrics("run") if r.get("step", 0) >= 1]
    address = d.cluster.hosts["train0"].address
    return Run(codes, rows, logs, d.workdir, address, engines_left, leftovers, time.monotonic() - started)
