"""``--async-save`` through the CLI (``--rollout-source synthetic``, no fleet): with a save every step, the
checkpoints written in the background hold exactly what the synchronous run's hold (the same fingerprints and the
same tensors, the reference after its reset and ``--save-hf``'s directory included), a resume from one of them is
bit for bit the uninterrupted run, a Ctrl-C to the run's process group while a save is written ends it with one line
within the heartbeat timeout and its resume is the uninterrupted run (two fixed points of tools/ctrl_c_probe.py,
which runs 50 random ones by hand), and the time a save holds the step is recorded (measured by
benchmarks/bench_checkpoint.py, not asserted here)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.cpu import PINNED_CPU_ENV
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


def _probe():
    """tools/ctrl_c_probe.py, the Ctrl-C probe run by hand, as a module."""
    spec = importlib.util.spec_from_file_location(
        "ctrl_c_probe", Path(__file__).parents[1] / "tools" / "ctrl_c_probe.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


CTRL_C_POINTS = (0.0, 0.15)
"""Seconds after the first save's writer forks: the window where 8 of 22 of the issue's probes hung."""


def _ctrl_c_then_resumed(root: Path) -> list[tuple]:
    """The async run, its process group sent SIGINT at each of :data:`CTRL_C_POINTS`, then resumed in place (``--load``
    = ``--save``) to step 3. Costs about 4 launches' start-ups (two interrupted after a step, two resumes of two
    steps): about 50 s of CPU on the 2-core machine."""
    probe = _probe()
    base = [sys.executable, "-m", "megatron_pacs.train", "--hf-model", str(root / "model")]
    base += ["--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS, *SYNTHETIC, *STEPS, "--async-save"]
    out = []
    for i, after in enumerate(CTRL_C_POINTS):
        # A point that missed the write (the writer forked and ended before the signal, on a loaded machine) is not
        # what this checks: it is tried again, twice at most (the anywhere-in-the-run case is the probe's,
        # docs/development.md).
        for attempt in range(3):
            save, logs = root / f"ctrl_c{i}_{attempt}", root / f"ctrl_c{i}_{attempt}_logs"
            result = probe.interrupt(
                [*base, "--save", str(save), "--log-dir", str(logs)],
                cwd=root,
                stderr=root / f"ctrl_c{i}_{attempt}.stderr",
                after_write=after,
                env=dict(os.environ, **PINNED_CPU_ENV),
            )
            if result.during_write:
                break
        resumed: list[dict] = []
        tracker = save / "latest_checkpointed_iteration.txt"
        if result.code == 130 and not (tracker.is_file() and tracker.read_text().strip() == "3"):
            resumed = _train(
                root, f"ctrl_c{i}_{attempt}_resumed", *STEPS, "--load", str(save), "--save", str(save), "--async-save"
            )
        out.append((result, probe.judge(result), resumed, save))
    return out


LAUNCHES = {
    "sync": _sync,
    "async": _async_then_resumed,
    "ctrl_c": _ctrl_c_then_resumed,
}  # queued (tests/launch_queue.py)


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


def test_ctrl_c_while_a_save_is_written_ends_with_one_line_and_resumes_bit_for_bit(launched):
    """Issue 53, item 1: a Ctrl-C 0.1-0.2 s into an ``--async-save`` write hung the run in 8 of 22 trials (the
    forked writer raised KeyboardInterrupt before posting its results; the shutdown's wait had no bound), and half
    printed ForkProcess tracebacks. Each fixed point: exit 130 within the heartbeat timeout, the interruption's line
    last, no traceback; the resumed run's steps and last checkpoint are the uninterrupted run's bit for bit."""
    continuous, _, async_root = launched["async"].result()
    steps = {m["step"]: m for m in continuous if "train/loss" in m}
    for result, wrong, resumed, save in launched["ctrl_c"].result():
        assert result.code == 130 and wrong == [], (wrong, result.stderr[-3000:])
        for m in resumed:
            if "train/loss" in m:
                keys = [k for k in m if k.startswith(("train/", "rollout/", "ref/")) and not k.endswith("per_second")]
                assert keys and {k: m[k] for k in keys} == {k: steps[m["step"]][k] for k in keys}, m["step"]
        fingerprint = "iter_0000003/fingerprint_rank00000.json"
        assert (save / fingerprint).read_text() == (async_root / fingerprint).read_text()
