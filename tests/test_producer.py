"""One-step-off-policy rollouts through the real trainer (fleet, scorer, Megatron; fp32 on CPU), from the golden
fixture's warmed-up model.

With ``--lr 0`` the policy never moves, so generating step k+1's rollouts during step k's update changes nothing:
per-step rewards, losses and gradient norms equal the synchronous run's exactly (also with the truncated
importance correction, whose ratios then compare the same weights in both runs). The lag and timing metrics say
what happened.

The synchronous run with the correction trains on the synchronous run's rollouts, replayed from its dumps
(``--rollout-source replay``, no fleet: the same tokens, rewards and engine log-probs, which the frozen policy's
engines would generate again).
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
from helpers.cpu import half_engine_pins
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS, refused_train, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GOLDEN = Path(__file__).parent / "golden"
FROZEN = ["--lr", "0", "--train-iters", "3", "--micro-batch-size", "3"]
TIS = ["--off-policy-correction", "tis"]
PP2 = ["--pipeline-model-parallel-size", "2"]
RUNS = {
    "sync": [*FROZEN],
    "off": [*FROZEN, "--off-policy-steps", "1", "--save", "CKPT", "--save-interval", "1", "--keep-last", "3"],
    "sync_tis": [*FROZEN, "--off-policy-correction", "tis", "--rollout-source", "replay", "--replay-from", "SYNC"],
    "off_tis": [*FROZEN, "--off-policy-steps", "1", "--off-policy-correction", "tis"],
    "grpo_tis_pp2": [*FROZEN[:2], "--train-iters", "1", "--micro-batch-size", "3", "--loss", "grpo", *TIS, *PP2],
}
WORLD = {"grpo_tis_pp2": 2}
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm", "pacs/loss")


def prepare(root: Path) -> Path:
    shutil.copytree(GOLDEN / "model", root / "model")
    shutil.copy(GOLDEN / "train.jsonl", root / "train.jsonl")
    return root


def _run(root: Path, name: str) -> list[dict]:
    replay = name in REPLAYS
    base = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl")]
    base += TINY_TRAIN_FLAGS if replay else TINY_RUN_FLAGS
    subs = {"CKPT": str(root / f"{name}_ckpt"), "SYNC": str(root / "sync")}
    flags = [subs.get(a, a) for a in RUNS[name]]
    world = WORLD.get(name, 1)
    history = run_train([*base, *flags], log_dir=root / name, cwd=root, world=world, without_fleet_stack=replay)
    return [m for m in history if "train/loss" in m]


REPLAYS = {"sync_tis": "sync"}  # run -> the run whose dumps it replays (after it, in the same launch of the queue)


def _off_resumed_bf16(root: Path) -> str:
    """``off`` resumed from its step-1 checkpoint (pending rollouts in it) with bf16 engines beside the fp32
    trainer and ``--max-logprob-diff 1e-3``: the run's stderr."""
    mid = root / "off_ckpt" / "iter_0000001"
    assert (mid / "pending_rollouts.pt").is_file()
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_RUN_FLAGS]
    flags += [*FROZEN[:2], "--micro-batch-size", "3", "--off-policy-steps", "1", "--train-iters", "3"]
    flags += ["--load", str(mid), "--rollout-dtype", "bfloat16", "--max-logprob-diff", "1e-3"]
    return refused_train(flags, log_dir=root / "bound_resumed", cwd=root, pins=half_engine_pins())


def _launch(root: Path, name: str) -> dict[str, list[dict] | str]:
    """Run ``name``, then the runs that replay its dumps (and, after ``off``, its bf16 resume); returns each run's
    steps (the bf16 resume: its stderr) by its name."""
    out: dict[str, list[dict] | str] = {}
    for run in (name, *(r for r, source in REPLAYS.items() if source == name)):
        out[run] = _run(root, run)
    if name == "off":
        out["off_resumed_bf16"] = _off_resumed_bf16(root)
    return out


# queued for the session (tests/launch_queue.py)
LAUNCHES = {name: partial(_launch, name=name) for name in RUNS if name not in REPLAYS}


@pytest.fixture(scope="module")
def runs(launch_queue) -> dict[str, list[dict] | str]:
    """Each run's steps by its name (the bf16 resume's: its stderr)."""
    futures = launch_queue.futures(__name__).values()
    return {name: out for future in futures for name, out in future.result().items()}


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


def test_token_level_tis_metrics_under_pipeline_parallelism_come_from_the_last_stage(runs):
    """GRPO's token ratios exist on the last pipeline stage only; the other stages' all-zero store would give
    1 / p_engine per token. Frozen and in sync, the ratio is 1 up to rounding, at PP=2 as at PP=1."""
    (m,) = runs["grpo_tis_pp2"]
    assert m["offpolicy/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["offpolicy/is_truncated"] == 0.0


def test_max_logprob_diff_is_enforced_one_step_off_after_a_resume(runs):
    """--max-logprob-diff compares the probe after every weight sync, in every mode: resumed one step off, the
    first step trains on the checkpoint's pending rollouts (generated before the resume, so no consistency check
    applies), yet engines now in bf16 beside the fp32 trainer (~1e-2 per token) stop the run at that step's sync
    (fresh runs: tests/test_reference.py; in sync, the same bound passes: ``t07`` there)."""
    stderr = runs["off_resumed_bf16"]
    assert "step 2: the engines' and the trainer's token log-probs (the sync probe" in stderr, stderr[-3000:]
    assert "--max-logprob-diff 0.001" in stderr
