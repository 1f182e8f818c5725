#!/usr/bin/env python
"""How long a checkpoint holds the training step: a save every step, synchronous (the baseline, run in the same
invocation) against ``--async-save``, through the trainer's CLI with ``--rollout-source synthetic`` on the CPU.

    python benchmarks/bench_checkpoint.py                       # the tiny shape and a ~100M-parameter one
    python benchmarks/bench_checkpoint.py --shapes tiny --steps 5

A save's hold is the time the step waits in :meth:`Trainer.save`: ``perf/time/save_wait`` (with ``--async-save``,
the wait for the previous save still in flight: at most one is) plus ``perf/time/save``, the save's own part (the
plans, the common state, on a GPU the host copy, and the fork of the writer, which then writes the shards and the
host tensors' fingerprint). It shows
in the row of the step after the save; the first two saves are left out (the first starts the writers' queue server,
the second waits for the first write, the slowest), and so is the run's last (waited for, in no row). ``step +
save`` is ``perf/time/step`` plus that hold: the loop's time per step with a save every step. Target (issue 41): an
asynchronous save holds the step for at most 10% of a synchronous one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # name -> tiny_hf_config arguments
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2),
    "100M": dict(hidden=1024, layers=12, heads=16, kv_heads=4),
}


def _setup(root: Path, shape: str) -> tuple[Path, Path, int]:
    """A random Qwen2 of ``shape`` and the demo's arithmetic problems; returns them and the parameter count."""
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=512)
    size = SHAPES[shape]
    cfg = tiny_hf_config(
        "qwen2",
        vocab_size=len(tok),
        hidden=size["hidden"],
        layers=size["layers"],
        heads=size["heads"],
        kv_heads=size["kv_heads"],
        tied=True,
    )
    model = build_tiny_model(str(root / shape / "model"), cfg, seed=0, tokenizer=tok, scale=3.0)
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(64, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return root / shape / "model", root / "train.jsonl", params


def _run(name: str, args: argparse.Namespace, model: Path, data: Path, work: Path, *extra: str) -> list[dict]:
    log_dir, save = work / f"{name}-log", work / f"{name}-ckpt"
    flags = ["--hf-model", str(model), "--train-data", str(data), "--train-iters", str(args.steps)]
    flags += ["--global-batch-size", "2", "--ppo-mini-batch-size", "2", "--group-size", "2"]
    flags += ["--max-response-length", "8", "--max-prompt-length", "96", "--no-dump-rollouts"]
    flags += ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]
    flags += ["--save", str(save), "--save-interval", "1", "--keep-last", "2", *extra]
    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in rows if "train/loss" in m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=5, help="steps per run (at least 4: the holds of saves 3..N-1)")
    args = ap.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            work = Path(tmp) / shape
            work.mkdir()
            model, data, params = _setup(work, shape)
            result = {}
            for mode, extra in (("sync", ()), ("async", ("--async-save",))):
                steps = _run(f"{shape}-{mode}", args, model, data, work, *extra)[3:]  # rows of saves 3..N-1
                own = statistics.median(m["perf/time/save"] for m in steps)
                hold = statistics.median(m["perf/time/save"] + m.get("perf/time/save_wait", 0.0) for m in steps)
                step = statistics.median(
                    m["perf/time/step"] + m["perf/time/save"] + m.get("perf/time/save_wait", 0.0) for m in steps
                )
                result[mode] = (step, hold, own)
            table.append((shape, params, result))
    print(f"\nmedian over saves 3-{args.steps - 1} (a save every step); baseline: the synchronous run here")
    print(
        "| shape | params | sync step + save (s) | async step + save (s) | sync save holds (s) "
        "| async save holds (s) | of which its own (s) | async / sync hold | own / sync hold |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, params, r in table:
        (s_step, s_hold, _), (a_step, a_hold, a_own) = r["sync"], r["async"]
        print(
            f"| {shape} | {params / 1e6:.1f}M | {s_step:.2f} | {a_step:.2f} | {s_hold:.3f} | {a_hold:.3f} "
            f"| {a_own:.3f} | {a_hold / s_hold:.1%} | {a_own / s_hold:.1%} |"
        )


if __name__ == "__main__":
    main()
