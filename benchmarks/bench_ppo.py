#!/usr/bin/env python
"""PPO against GRPO on the same shapes, in one invocation: step time and peak memory through the trainer's CLI.

Both runs train on ``--rollout-source synthetic`` (the same seeded rollouts: the training phase is what the critic
changes: its values pass, its update and its second set of weights, gradients and Adam state), one process each, in
two model sizes: the demo's tiny Qwen2 and a ~90M one (1024 hidden, 8 layers), both built here. The step time is the
median of ``perf/time/step`` over the steps after the first (which compiles and warms caches); with
``--critic-warmup 0`` every PPO step trains both models. Peak memory is the run's peak resident set (``ru_maxrss`` of
that process, from ``os.wait4``): on a CPU all of the model's memory; on a GPU read ``nvidia-smi`` or the device
allocator instead. The one published anchor: ReMax (arXiv 2310.10505) saw PPO about 1.6x slower than its critic-free
method and needing about 1.9x the GPU memory at 7B.

    python benchmarks/bench_ppo.py                      # both sizes, 4 steps each
    python benchmarks/bench_ppo.py --sizes tiny --steps 6 -- --bf16
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
SIZES = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2},
    "90m": {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 8},
}


def _model(root: Path, size: str) -> tuple[Path, Path, int]:
    """A Qwen2 of ``size`` with the demo's tokenizer, its arithmetic prompts, and its parameter count."""
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config
    from megatron_pacs.planner import ModelShape

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), tied=True, **SIZES[size])
    if size != "tiny":
        cfg.intermediate_size = 2816
    model = root / size
    build_tiny_model(str(model), cfg, seed=0, tokenizer=tok, scale=3.0)
    data = root / "train.jsonl"
    with open(data, "w") as f:
        for row in make_problems(64, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return model, data, ModelShape.from_pretrained(model).num_params()


def _run(loss: str, args: argparse.Namespace, model: Path, data: Path, log_dir: Path) -> tuple[list[dict], float]:
    """One training run; its metric rows and its peak resident set in GiB."""
    flags = ["--hf-model", str(model), "--train-data", str(data), "--train-iters", str(args.steps), "--loss", loss]
    flags += ["--global-batch-size", str(args.global_batch_size), "--group-size", str(args.group_size)]
    flags += ["--ppo-mini-batch-size", str(args.global_batch_size), "--micro-batch-size", "8"]
    flags += ["--max-response-length", str(args.max_response_length), "--max-prompt-length", "96"]
    flags += ["--rollout-source", "synthetic", "--no-dump-rollouts", *args.extra]
    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    with open(log_dir.with_suffix(".log"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{loss} run failed:\n{log_dir.with_suffix('.log').read_text()[-4000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, usage.ru_maxrss / 1024**2  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-response-length", type=int, default=32)
    ap.add_argument("extra", nargs="*", help="further trainer flags for both runs (after --)")
    args = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            work = Path(tmp) / size
            work.mkdir()
            model, data, params = _model(work, size)
            result = {}
            for loss in ("grpo", "ppo"):
                rows, peak_gb = _run(loss, args, model, data, work / loss)
                step_s = statistics.median(m["perf/time/step"] for m in rows[1:])
                critic = statistics.median(
                    m.get("perf/time/critic_values", 0.0) + m.get("perf/time/critic_update", 0.0) for m in rows[1:]
                )
                result[loss] = (step_s, critic, peak_gb)
            (g_step, _, g_peak), (p_step, p_critic, p_peak) = result["grpo"], result["ppo"]
            lines.append(
                f"| {size} ({params / 1e6:.1f}M) | {g_step:.2f} | {p_step:.2f} ({p_critic:.2f} critic) | "
                f"{p_step / g_step:.2f}x | {g_peak:.2f} | {p_peak:.2f} | {p_peak / g_peak:.2f}x |"
            )
    print(f"\nmedian of steps 2-{args.steps}; baseline: the GRPO run of the same shape in this invocation")
    print(
        "| model | GRPO step (s) | PPO step (s) | PPO / GRPO | GRPO peak RSS (GiB) | PPO peak RSS (GiB) | PPO / GRPO |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
