"""Rollouts as tensors (megatron_pacs.distribute) on 4 real gloo ranks: every rank receives exactly its data-parallel
share (sequences, engine log-probs) and the step's metadata, with and without packing's balanced shares; at DP=4,
at PP=2 x DP=2 and TP=2 x DP=2, where each leader passes its share on to its pipeline or tensor-parallel peer;
and the driver's stop in place of a step's rollouts (a rollout cluster that did not come back) raised on every
other rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).parent


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 1)], ids=["dp4", "pp2_dp2", "tp2_dp2"])
def test_every_rank_receives_exactly_its_share(tmp_path, tp, pp):
    cmd = [sys.executable, str(HERE / "distribute_checks.py"), "--out", str(tmp_path), "--tp", str(tp), "--pp", str(pp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    failures = json.loads((tmp_path / f"transport_tp{tp}_pp{pp}.json").read_text())
    assert failures == []
