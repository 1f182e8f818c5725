"""One-step-off-policy rollouts through the real trainer (fleet, scorer, Megatron; fp32 on CPU), from the golden
fixture's warmed-up model.

With ``--lr 0`` the policy never moves, so generating step k+1's rollouts during step k's update changes nothing:
per-step rewards, losses and gradient norms equal the synchronous run's exactly (also with the truncated
importance correction, whose ratios then compare the same weights in both runs). The lag and timing metrics say
what happened.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import TINY_RUN_FLAGS, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GOLDEN = Path(__file__).parent / "golden"
FROZEN = ["--lr", "0", "--train-iters", "3", "--micro-batch-size", "3"]
RUNS = {
    "sync": [*FROZEN],
    "off": [*FROZEN, "--off-policy-steps", "1"],
    "sync_tis": [*FROZEN, "--off-policy-correction", "tis"],
    "off_tis": [*FROZEN, "--off-policy-steps", "1", "--off-policy-correction", "tis"],
}
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm", "pacs/loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("overlap")
    shutil.copytree(GOLDEN / "model", root / "model")
    shutil.copy(GOLDEN / "train.jsonl", root / "train.jsonl")
    base = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_RUN_FLAGS]

    def launch(name: str) -> list[dict]:
        return [m for m in run_train([*base, *RUNS[name]], log_dir=root / name, cwd=root) if "train/loss" in m]

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RUNS, pool.map(launch, RUNS), strict=True))


@pytest.mark.parametrize(("sync", "off"), [("sync", "off"), ("sync_tis", "off_tis")])
def test_frozen_policy_one_step_off_equals_synchronous_exactly(runs, sync, off):
    assert len(runs[sync]) == len(runs[off]) == 3
    for a, b in zip(runs[sync], runs[off], strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, (a["step"], sync, off)
    assert 0 < runs[sync][0]["rollout/reward_mean"] < 1  # mixed rewards: a real gradient


def test_lag_and_timing_metrics(runs):
    assert [m["rollout/policy_lag"] for m in runs["off"]] == [0.0, 1.0, 1.0]
    assert [m["rollout/policy_lag"] for m in runs["sync"]] == [0.0, 0.0, 0.0]
    for name in ("sync", "off"):
        for m in runs[name]:
            step = m["perf/time/step"]
            assert step > 0 and 0 <= m["perf/time/overlap_hidden"] <= step
            assert 0 <= m["perf/time/idle_trainer"] <= step and 0 <= m["perf/time/idle_engines"] <= step
    assert all(m["perf/time/overlap_hidden"] == 0.0 for m in runs["sync"])  # nothing overlaps when synchronous
    assert runs["off"][1]["perf/time/overlap_hidden"] > 0.0  # step 3's rollouts generated during step 2's update
    assert runs["off_tis"][0]["offpolicy/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # engine vs trainer only
