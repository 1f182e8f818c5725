#!/usr/bin/env python
"""Asynchronous rollouts: throughput and idle time of on-policy (the baseline, same run), one step off, and
``--max-staleness`` 2 and 4 with partial rollouts, through the real trainer and fleet on the demo's warmed-up tiny
model; optionally the reward curves of on-policy and K=4 over the demo's steps, per seed, with a plot.

The response lengths are long-tailed: the demo's model answers in about 20 tokens; ``--eos-scale s`` multiplies its
end-of-sequence logit by s (an untied copy of the output layer), so that at temperature 1 some responses miss their
end and run on, a few to ``--max-response-length``; a synchronous step waits for its longest response.

Per schedule: rollout tokens per second (the steps after the first, whose start-up no schedule shares), the median
step time, and the mean engine and trainer idle time per step, with the ratio of tokens/s to on-policy's. The
partial-rollout schedules run once per ``--round-tokens`` value (``--rollout-round-tokens``).

The learning comparison trains on-policy and K=4 for ``--learning-steps`` steps per seed and reports two rewards: the
training batches' over the last 5 steps, and the final policy's on 64 held-out problems (greedy, the demo's
validation). Under K=4 a step's batch was sampled by weights up to 4 updates older than the step's own, so its reward
lags the policy it reports on; the held-out reward is that of the weights after the last step.

    python benchmarks/bench_async.py [--out runs/bench_async] [--steps 12] [--max-response-length 96] [--eos-scale 0.4]
        [--round-tokens 16 32] [--learning-steps 30 --seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCHEDULES = {
    "on-policy": [],
    "one step off": ["--off-policy-steps", "1"],
    "K=2, partial": ["--max-staleness", "2", "--partial-rollouts"],
    "K=4, partial": ["--max-staleness", "4", "--partial-rollouts"],
}
LEARNING = ("on-policy", "K=4, partial")


def _schedules(args: argparse.Namespace) -> dict[str, list[str]]:
    """The selected schedules, the partial-rollout ones once per ``--round-tokens`` value."""
    out = {}
    for name in args.schedules:
        if "--partial-rollouts" not in SCHEDULES[name]:
            out[name] = SCHEDULES[name]
            continue
        for tokens in args.round_tokens:
            label = name if len(args.round_tokens) == 1 else f"{name}, rounds of {tokens}"
            out[label] = [*SCHEDULES[name], "--rollout-round-tokens", str(tokens)]
    return out


def _flags(model: Path, data: Path, args: argparse.Namespace) -> list[str]:
    from megatron_pacs.demo.run import RL_FLAGS

    rl = list(RL_FLAGS)
    i = rl.index("--eval-interval")
    del rl[i : i + 2]  # no validation: the steps' own time only
    i = rl.index("--max-response-length")
    rl[i + 1] = str(args.max_response_length)
    return [*rl, "--hf-model", str(model), "--train-data", str(data), "--off-policy-correction", "tis"]


def long_tailed(warm: Path, out: Path, scale: float) -> Path:
    """A copy of the warmed-up model whose end-of-sequence logit is multiplied by ``scale`` (1: the model itself)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    if scale == 1.0:
        return warm
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(warm, out)
    weights = load_file(str(warm / "model.safetensors"))
    config = json.loads((warm / "config.json").read_text())
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).clone()
    head[AutoTokenizer.from_pretrained(str(warm)).eos_token_id] *= scale
    weights["lm_head.weight"] = head.to(torch.float32).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _run(flags: list[str], log_dir: Path) -> list[dict]:
    import shutil

    shutil.rmtree(log_dir, ignore_errors=True)  # this benchmark's own earlier run of the schedule
    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in rows if "train/loss" in m]


def _summary(steps: list[dict]) -> dict[str, float]:
    timed = steps[1:]
    tokens = sum(m["rollout/num_tokens"] for m in timed)
    seconds = sum(m["perf/time/step"] for m in timed)
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": statistics.median(m["perf/time/step"] for m in timed),
        "idle_engines_s": statistics.mean(m["perf/time/idle_engines"] for m in timed),
        "idle_trainer_s": statistics.mean(m["perf/time/idle_trainer"] for m in timed),
        "response_len_mean": statistics.mean(m["rollout/response_len_mean"] for m in timed),
        "response_len_max": max(m["rollout/response_len_max"] for m in timed),
        "clip_ratio": statistics.mean(m["rollout/clip_ratio"] for m in timed),
        "staleness_max": max(m.get("rollout/staleness_token_max", m.get("rollout/policy_lag", 0.0)) for m in timed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    p.add_argument("--steps", type=int, default=12, help="steps per schedule for the throughput table")
    p.add_argument("--max-response-length", type=int, default=96)
    p.add_argument("--eos-scale", type=float, default=0.4, help="1: the demo model's own lengths")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument(
        "--round-tokens",
        type=int,
        nargs="+",
        default=[16, 32],
        help="--rollout-round-tokens values (the first: learning)",
    )
    p.add_argument("--learning-steps", type=int, default=0, help="0: no learning comparison")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args()

    from megatron_pacs.demo import task as demo_task
    from megatron_pacs.demo.run import _write_jsonl, warm_up

    args.out.mkdir(parents=True, exist_ok=True)
    model = long_tailed(warm_up(args.out, 0), args.out / f"eos_{args.eos_scale:g}", args.eos_scale)
    data = args.out / "train.jsonl"
    _write_jsonl(demo_task.make_problems(640, seed=0, split="train"), data)
    base = _flags(model, data, args)

    table = {}
    for name, extra in _schedules(args).items():
        log_dir = args.out / "throughput" / name.replace(" ", "_").replace(",", "").replace("=", "")
        steps = _run([*base, "--train-iters", str(args.steps), *extra], log_dir)
        table[name] = _summary(steps)
        print(f"{name}: {table[name]}", flush=True)
    baseline = table[next(iter(table))]["tokens_per_s"]
    print(f"\nbaseline: {args.schedules[0]}, same run; {args.steps} steps each, the first excluded")
    print(f"end-of-sequence logit x{args.eos_scale:g}, --max-response-length {args.max_response_length}")
    print(f"--rollout-round-tokens {' '.join(map(str, args.round_tokens))}")
    print(
        "| schedule | tokens/s | x on-policy | step s (median) | engines idle s | trainer idle s | resp len mean/max "
        "| staleness max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in table.items():
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / baseline:.2f} | {r['step_s']:.2f} | "
            f"{r['idle_engines_s']:.2f} | {r['idle_trainer_s']:.2f} | {r['response_len_mean']:.1f}/"
            f"{r['response_len_max']:.0f} | {r['staleness_max']:.0f} |"
        )
    (args.out / "throughput.json").write_text(json.dumps(table, indent=2))
    if args.learning_steps:
        _learning(base, args, _write_jsonl)


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _learning(base: list[str], args: argparse.Namespace, write_jsonl) -> None:
    from megatron_pacs.demo import task as demo_task
    from megatron_pacs.utils.plot import plot_runs

    val = args.out / "val.jsonl"
    write_jsonl(demo_task.make_problems(64, seed=0, split="val"), val)
    held_out = ["--val-data", str(val), "--eval-interval", str(args.learning_steps)]  # at the start and the end
    schedules = _schedules(argparse.Namespace(schedules=list(LEARNING), round_tokens=args.round_tokens[:1]))
    curves: dict[str, list[float]] = {}
    final: dict[str, float] = {}
    dirs = []
    for name, extra in schedules.items():
        for seed in args.seeds:
            log_dir = args.out / "learning" / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_s{seed}"
            flags = [*base, *extra, *held_out, "--train-iters", str(args.learning_steps), "--seed", str(seed)]
            steps = _run(flags, log_dir)
            label = f"{name}, seed {seed}"
            curves[label] = [m["rollout/reward_mean"] for m in steps]
            final[label] = next(v for k, v in steps[-1].items() if k.startswith("val/") and k.endswith("/reward_mean"))
            dirs.append(log_dir)
    print("\n| schedule | seed | batch reward, first 5 steps | batch reward, last 5 steps | held-out reward, final |")
    print("|---|---|---|---|---|")
    for label, rewards in curves.items():
        name, seed = label.rsplit(", seed ", 1)
        first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
        print(f"| {name} | {seed} | {first:.3f} | {last:.3f} | {final[label]:.3f} |")
    print("\n| schedule | batch reward, last 5 steps (mean, sd) | held-out reward, final (mean, sd) |")
    print("|---|---|---|")
    for name in schedules:
        last = [statistics.mean(curves[f"{name}, seed {s}"][-5:]) for s in args.seeds]
        held = [final[f"{name}, seed {s}"] for s in args.seeds]
        cells = [f"{statistics.mean(xs):.3f} ({_sd(xs):.3f})" for xs in (last, held)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    (args.out / "learning.json").write_text(json.dumps({"curves": curves, "held_out_final": final}, indent=2))
    plot_runs(dirs, args.out / "learning.png", keys=["rollout/reward_mean"], labels=list(curves), smooth=3)
    print(f"plot: {args.out / 'learning.png'}")


if __name__ == "__main__":
    main()
