"""Rollouts as tensors (megatron_pacs.distribute) on 4 real gloo ranks: every rank receives exactly its data-parallel
share (sequences, engine log-probs) and the step's metadata, with and without packing's balanced shares; at DP=4,
at PP=2 x DP=2 and TP=2 x DP=2, where each leader passes its share on to its pipeline or tensor-parallel peer;
and the driver's stop in place of a step's rollouts (a rollout cluster that did not come back) raised on every
other rank."""

import json
import os
import sys
from pathlib import Path

import pytest
from launch_queue import run_launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).parent


LAYOUTS = {"dp4": (1, 1), "pp2_dp2": (1, 2), "tp2_dp2": (2, 1)}


def prepare(root: Path) -> Path:
    return root


def _checks(out: Path) -> Path:
    """One launch of 4 ranks checks every layout in turn (their start-up is most of its time)."""
    layouts = ",".join(f"{tp}x{pp}" for tp, pp in LAYOUTS.values())
    cmd = [sys.executable, str(HERE / "distribute_checks.py"), "--out", str(out), "--layouts", layouts]
    proc = run_launch(cmd, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


LAUNCHES = {"checks": _checks}  # queued for the session (tests/launch_queue.py), beside the in-process tests


@pytest.fixture(scope="module")
def checked(launched) -> Path:
    return launched["checks"].result()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_receives_exactly_its_share(checked, layout):
    tp, pp = LAYOUTS[layout]
    failures = json.loads((checked / f"transport_tp{tp}_pp{pp}.json").read_text())
    assert failures == []
