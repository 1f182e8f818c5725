"""The trainer without the fleet: ``--rollout-source synthetic`` through the CLI, with Ray, vLLM and math-verify
absent from the process, the reference policy with a reset, a save and a resume (resume == continuous, bit for
bit), and the step's time split with the weight export's time."""

from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_TRAIN_FLAGS, make_rl_setup, run_train

from megatron_pacs.sources.dumps import read_dump_metadata

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]
SYNTHETIC += ["--pacs-score-reference", "ref", "--ref-reset-interval", "2", "--kl-coef", "0.01"]
SYNTHETIC += ["--deterministic-mode"]  # as tools/gpu_check.py runs it on a GPU (the CPU is deterministic either way)


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=True, num_problems=8)


def _train(root: Path, name: str, *extra: str) -> list[dict]:
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS]
    return run_train([*flags, *SYNTHETIC, *extra], log_dir=root / name, cwd=root, without_fleet_stack=True)


def _continuous_then_resumed(root: Path) -> tuple[list[dict], list[dict]]:
    save = ["--save", str(root / "ckpt"), "--save-interval", "1", "--keep-last", "3", "--save-hf"]
    continuous = _train(root, "continuous", "--train-iters", "3", *save)
    mid = root / "ckpt" / "iter_0000002"
    resumed = _train(
        root, "resumed", "--train-iters", "3", "--load", str(mid), "--save", str(root / "ckpt_r"), "--save-hf"
    )
    return continuous, resumed


LAUNCHES = {"chain": _continuous_then_resumed}  # queued for the session (tests/launch_queue.py)


def test_synthetic_rollouts_train_without_the_fleet_stack(launched):
    continuous, _ = launched["chain"].result()
    steps = [m for m in continuous if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert 0 < m["rollout/reward_mean"] < 1 and m["train/grad_norm"] > 0
        assert m["perf/time/synthesize"] > 0 and m["perf/time/sync"] > 0  # the weight export, with no engines
        assert "perf/time/generate" not in m and "sync/max_logprob_diff" not in m
        assert m["data/dropped_prompts"] == 0.0 and m["rollout/empty_responses"] == 0.0
        assert not any(k.startswith("consistency/") for k in m)  # no engine log-probs to compare with
    assert [m["ref/resets"] for m in steps] == [0.0, 1.0, 1.0]


def test_a_synthetic_run_resumed_equals_the_continuous_one(launch_queue, launched):
    root = launch_queue.root(__name__)
    continuous, resumed = launched["chain"].result()
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "ref/kl", "ref/resets")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: continuous[-1][k] for k in keys}]
    from safetensors.torch import load_file

    a = load_file(str(root / "ckpt" / "iter_0000003" / "hf" / "model.safetensors"))
    b = load_file(str(root / "ckpt_r" / "iter_0000003" / "hf" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = read_dump_metadata(root / "continuous" / "rollouts" / "step_000001.safetensors")
    assert meta["group_size"] == 4 and len(meta["prompt_ids"]) == 4  # replayable like a fleet run's dumps
