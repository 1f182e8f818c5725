#!/usr/bin/env python
"""The training phase alone: ``--rollout-source synthetic`` against the fleet, through the trainer's CLI.

A synthetic run does everything a fleet run does after generation (the rollouts' distribution, old and reference
log-probs, the loss, the optimizer, the weight export with its TP/PP gathers, metrics), so its step time is the
training phase; the fleet run of the same shape, measured in the same invocation, is the baseline that shows how
much of a whole step that is. Steps after the first are timed (the first compiles and warms caches).

    python benchmarks/bench_training_phase.py                  # CPU: the demo's tiny model, fleet vs synthetic
    python benchmarks/bench_training_phase.py --sources synthetic --hf-model DIR --train-data FILE \
        --global-batch-size 64 --group-size 8 --max-response-length 4096 --peak-tflops 989 -- --bf16

One process (CPU or one GPU); trainer flags go after ``--``. MFU: the matmul FLOPs of the step's real tokens (6 N per
token, as bench_train_step.py counts them, without attention's quadratic term) over the training phase's time and
``--peak-tflops``; without it MFU is not shown.
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


def _tiny(root: Path) -> tuple[Path, Path]:
    """The demo's tiny Qwen2 and its arithmetic problems (the CLI tests' set-up)."""
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=True)
    build_tiny_model(str(root / "model"), cfg, seed=0, tokenizer=tok, scale=3.0)
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(64, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return root / "model", root / "train.jsonl"


def _run(source: str, args: argparse.Namespace, model: Path, data: Path, work: Path) -> list[dict]:
    log_dir = work / source
    flags = ["--hf-model", str(model), "--train-data", str(data), "--train-iters", str(args.steps)]
    flags += ["--global-batch-size", str(args.global_batch_size), "--group-size", str(args.group_size)]
    flags += [
        "--ppo-mini-batch-size",
        str(args.global_batch_size),
        "--max-response-length",
        str(args.max_response_length),
    ]
    flags += ["--max-prompt-length", str(args.max_prompt_length), "--no-dump-rollouts", "--rollout-source", source]
    flags += args.extra
    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{source} run failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _flops_per_token(model: Path) -> float:
    cfg = json.loads((model / "config.json").read_text())
    h, f, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    return 6.0 * (layers * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * f) + vocab * h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", nargs="+", default=["fleet", "synthetic"], choices=["fleet", "synthetic"])
    ap.add_argument("--hf-model", type=Path, help="default: the demo's tiny model, built here")
    ap.add_argument("--train-data", type=Path, help="with --hf-model: its prompts (synthetic uses their count only)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-prompt-length", type=int, default=96)
    ap.add_argument("--max-response-length", type=int, default=32)
    ap.add_argument("--peak-tflops", type=float, help="per-rank peak (e.g. 989 for an H100's dense bf16)")
    ap.add_argument("extra", nargs="*", help="further trainer flags (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = (args.hf_model, args.train_data) if args.hf_model else _tiny(work)
        rows = {}
        for source in args.sources:
            steps = [m for m in _run(source, args, model, data, work) if "train/loss" in m][1:]
            step_s = statistics.median(m["perf/time/step"] for m in steps)
            rollout_s = statistics.median(
                m.get("perf/time/generate", 0.0) + m.get("perf/time/reward", 0.0) + m.get("perf/time/synthesize", 0.0)
                for m in steps
            )
            tokens = statistics.median(m["rollout/num_tokens"] for m in steps)
            rows[source] = (step_s, step_s - rollout_s, tokens, statistics.median(m["perf/time/sync"] for m in steps))
        base = rows.get("fleet")
        print(f"\nmedian of steps 2-{args.steps}; baseline: the fleet run of the same shape in this invocation")
        print("| source | step (s) | training phase (s) | of the fleet's step | export / sync (s) | tokens/s | MFU |")
        print("|---|---|---|---|---|---|---|")
        flops = _flops_per_token(model)
        for source, (step_s, train_s, tokens, sync_s) in rows.items():
            share = f"{train_s / base[0]:.2f}x" if base else "n/a"
            mfu = f"{flops * tokens / train_s / (args.peak_tflops * 1e12):.1%}" if args.peak_tflops else "n/a"
            print(
                f"| {source} | {step_s:.2f} | {train_s:.2f} | {share} | {sync_s:.3f} | {tokens / step_s:.0f} | {mfu} |"
            )


if __name__ == "__main__":
    main()
