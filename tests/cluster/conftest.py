"""Fixtures of the virtual-cluster tests: the skip (a failure under ``CI=true``), the tiny model and data, and a
cluster that is always torn down (test failure, timeout, Ctrl-C or SIGTERM to pytest)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deploy import HOSTS, Deployment  # noqa: E402
from netns import VirtualCluster, namespaces_unavailable  # noqa: E402


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip where network namespaces cannot be made; under CI (``CI=true``) that is a failure instead."""
    why = namespaces_unavailable()
    if why is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the virtual-cluster tests cannot run: {why}")
    pytest.skip(f"virtual cluster unavailable: {why}")


@pytest.fixture(scope="session")
def cluster_setup(tmp_path_factory) -> Path:
    """The tiny Qwen2 and its ``train.jsonl`` (tests/conftest.py's make_rl_setup), on the shared filesystem."""
    from conftest import make_rl_setup

    return make_rl_setup(tmp_path_factory.mktemp("cluster_setup"), tied=False, num_problems=32)


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(f"pytest got signal {signum}")


@pytest.fixture
def deployment(netns_ok, cluster_setup, tmp_path):
    """A fresh 2 + 2 host virtual cluster (no processes yet) with its :class:`Deployment`; torn down afterwards,
    and checked to leave no namespace behind."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # Ctrl-C already raises KeyboardInterrupt
    cluster = VirtualCluster(HOSTS, tmp_path)
    try:
        yield Deployment(cluster, tmp_path, cluster_setup)
    finally:
        try:
            cluster.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert not cluster.exists(), "the virtual cluster's namespaces or bridge are left behind"
