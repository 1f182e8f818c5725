"""``--async-save`` through the CLI (``--rollout-source synthetic``, no fleet): with a save every step, the
checkpoints written in the background hold exactly what the synchronous run's hold (the same fingerprints and the
same tensors, the reference after its reset and ``--save-hf``'s directory included), a resume from one of them is
bit for bit the uninterrupted run, and the time a save holds the step is recorded (measured by
benchmarks/bench_checkpoint.py, not asserted here)."""

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_TRAIN_FLAGS, make_rl_setup, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]
SYNTHETIC += ["--pacs-score-reference", "ref", "--ref-reset-interval", "2", "--kl-coef", "0.01"]
STEPS = ["--train-iters", "3", "--save-interval", "1", "--keep-last", "3"]


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=True, num_problems=8)


def _train(root: Path, name: str, *extra: str) -> list[dict]:
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS]
    return run_train([*flags, *SYNTHETIC, *extra], log_dir=root / name, cwd=root, without_fleet_stack=True)


def _sync(root: Path) -> tuple[list[dict], Path]:
    return _train(root, "sync", *STEPS, "--save", str(root / "sync")), root / "sync"


def _async_then_resumed(root: Path) -> tuple[list[dict], list[dict], Path]:
    continuous = _train(root, "async", *STEPS, "--save", str(root / "async"), "--async-save", "--save-hf")
    mid = root / "async" / "iter_0000002"
    resumed = _train(root, "resumed", *STEPS, "--load", str(mid), "--save", str(root / "resumed"), "--async-save")
    return continuous, resumed, root / "async"


LAUNCHES = {"sync": _sync, "async": _async_then_resumed}  # queued for the session (tests/launch_queue.py)


def _tensors(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint folder, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def test_background_checkpoints_hold_what_synchronous_ones_hold(launched, tmp_path):
    _, sync_root = launched["sync"].result()
    *_, async_root = launched["async"].result()
    for step in (1, 2, 3):
        name = f"iter_{step:07d}"
        sync, background = sync_root / name, async_root / name
        assert json.loads((background / "megatron_pacs.json").read_text())["step"] == step
        for sub in ("", "reference") if step >= 2 else ("",):
            fingerprint = "fingerprint_rank00000.json"
            assert (sync / sub / fingerprint).read_text() == (background / sub / fingerprint).read_text()
            a = _tensors(sync / sub, tmp_path / f"s{step}{sub}.pt")
            b = _tensors(background / sub, tmp_path / f"a{step}{sub}.pt")
            assert a.keys() == b.keys() and a
            assert all(torch.equal(a[k], b[k]) for k in a), (step, sub)
        assert (background / "hf" / "config.json").is_file()  # --save-hf, committed with the checkpoint
    assert (async_root / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert not [p for p in async_root.iterdir() if ".tmp-" in p.name]


def test_a_resume_from_a_background_checkpoint_is_the_uninterrupted_run(launched):
    continuous, resumed, _ = launched["async"].result()
    last = next(m for m in continuous if m.get("step") == 3 and "train/loss" in m)
    again = next(m for m in resumed if m.get("step") == 3 and "train/loss" in m)
    keys = [k for k in last if k.startswith(("train/", "rollout/", "ref/")) and not k.endswith("per_second")]
    assert keys and {k: again[k] for k in keys} == {k: last[k] for k in keys}


def test_the_time_a_save_holds_the_step_is_recorded(launched):
    """Recorded only (printed with -s): timing on a shared CPU is the benchmark's, not a test's."""
    sync = [m.get("perf/time/save") for m in launched["sync"].result()[0] if "train/loss" in m]
    background = [m.get("perf/time/save") for m in launched["async"].result()[0] if "train/loss" in m]
    print(f"perf/time/save per step: synchronous {sync}, --async-save {background}")
    assert all(t is not None and t >= 0 for t in [*sync[1:], *background[1:]])
