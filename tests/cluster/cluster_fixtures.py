"""Fixtures of the virtual-cluster tests: the skip (a failure under ``CI=true``), the tiny model and data, and a
cluster that is always torn down (test failure, timeout, Ctrl-C or SIGTERM to pytest). Test modules import them
(no conftest.py here: ``from conftest import ...`` in the suite means tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from deploy import HOSTS, Deployment
from netns import VirtualCluster, namespaces_unavailable

__all__ = ["Run", "cluster_setup", "continuous", "deployment", "netns_ok", "wait_engines_gone"]


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip where network namespaces cannot be made; under CI (``CI=true``) that is a failure instead."""
    why = namespaces_unavailable()
    if why is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the virtual-cluster tests cannot run: {why}")
    pytest.skip(f"virtual cluster unavailable: {why}")


#: One setup and one continuous run per session: test modules import these fixtures, and pytest would otherwise make
#: a session fixture once per importing module.
_SESSION: dict[str, object] = {}


@pytest.fixture(scope="session")
def cluster_setup(tmp_path_factory) -> Path:
    """The tiny Qwen2 and its ``train.jsonl`` (tests/conftest.py's make_rl_setup), on the shared filesystem."""
    from conftest import make_rl_setup

    if "setup" not in _SESSION:
        _SESSION["setup"] = make_rl_setup(tmp_path_factory.mktemp("cluster_setup"), tied=False, num_problems=32)
    return cast(Path, _SESSION["setup"])


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


@pytest.fixture
def deployment(netns_ok, cluster_setup, tmp_path) -> Iterator[Deployment]:
    """A fresh virtual cluster for one test (see :func:`virtual_deployment`)."""
    with virtual_deployment(cluster_setup, tmp_path) as d:
        yield d


@dataclass
class Run:
    """What a finished deployment left: exit codes, metrics rows (steps >= 1), the hosts' logs, and what was still
    running on the rollout hosts after the trainers ended and on any host after the rollout hosts were stopped."""

    codes: dict[str, int | None]
    rows: list[dict]
    logs: str
    workdir: Path
    train0_address: str
    engines_left: dict[str, list[int]]
    leftovers: dict[str, list[int]]
    seconds: float


def wait_engines_gone(d: Deployment, timeout: float = 90.0) -> dict[str, list[int]]:
    """Engine actor processes still alive on the rollout hosts after ``timeout`` (bounded poll)."""
    deadline = time.monotonic() + timeout
    while (left := {h: p for h, p in d.engine_pids().items() if p}) and time.monotonic() < deadline:
        time.sleep(1)
    return left


@pytest.fixture(scope="session")
def continuous(netns_ok, cluster_setup, tmp_path_factory) -> Run:
    """The documented deployment's 3 steps, uninterrupted (the reference of the fault tests)."""
    if "continuous" not in _SESSION:
        _SESSION["continuous"] = _run_continuous(cluster_setup, tmp_path_factory.mktemp("continuous"))
    return cast(Run, _SESSION["continuous"])


def _run_continuous(setup: Path, workdir: Path) -> Run:
    started = time.monotonic()
    with virtual_deployment(setup, workdir) as d:
        d.start_rollout_cluster()
        d.start_trainers("run", "--max-logprob-diff", "1e-5")  # every sync probed; stops the run above the bound
        codes = d.wait_trainers(timeout=600)
        engines_left = wait_engines_gone(d)
        for host in ("rollout-head", "rollout1"):
            d.cluster.stop_host(host)
        leftovers = d.cluster.leftovers()
        logs = "".join(p.read_text(errors="replace") for p in sorted((d.workdir / "logs").glob("*.log")))
        rows = [r for r in d.metrics("run") if r.get("step", 0) >= 1]
        address = d.cluster.hosts["train0"].address
    return Run(codes, rows, logs, d.workdir, address, engines_left, leftovers, time.monotonic() - started)
