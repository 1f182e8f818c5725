"""The embedded default run: a complete small PACS experiment on a CPU, with no downloads (``make demo``).

1. Build a tokenizer and a tiny random Qwen2-style model locally (``--model-type qwen3_moe``: a tiny Qwen3-MoE).
2. Warm it up with supervised fine-tuning on a synthetic verifiable task (arithmetic with ``\\boxed{}`` answers)
   through the same Megatron stack the trainer uses.
3. Train it with PACS through the real pieces: the Ray-managed vLLM fleet, math-verify rewards in the scorer pool,
   the Megatron actor, weight sync every step.
4. Print the reward curve, write ``reward_curve.png`` and ``summary.json`` (``first5_reward_mean``,
   ``last5_reward_mean``, ``wall_s``).

Each RL run starts afresh in ``<out>/<loss>`` (the previous demo's run there is removed first: a run's log folder
holds one run); the warm-up in ``<out>/warm`` is reused.

``--compare`` (``make demo-compare``) trains PACS, GRPO and PPO from the same warm-up and seeds and plots all three
(PPO's critic at 10x the actor's learning rate, the released run's ratio). Trainer flags after ``--`` go to every
run (e.g. PACS v2: ``-- --pacs-score-reference ref --ref-reset-interval 10``).

    python -m megatron_pacs.demo [--out runs/demo] [--steps 30] [--compare] [--model-type qwen2|qwen3_moe]
        [-- TRAINER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from megatron_pacs.utils.logging import get_logger

log = get_logger("demo")

# The model, task and warm-up recipe live in megatron_pacs/demo/task.py (calibrated: T=1 accuracy ~0.3 after it).
RL_FLAGS = [
    "--global-batch-size",
    "16",
    "--group-size",
    "8",
    "--ppo-mini-batch-size",
    "8",
    "--micro-batch-size",
    "64",
    "--max-prompt-length",
    "96",
    "--max-response-length",
    "24",
    "--lr",
    "2e-4",
    "--weight-decay",
    "0.0",
    "--pacs-beta",
    "1.0",
    "--temperature",
    "1.0",
    "--reward-workers",
    "1",
    "--eval-interval",
    "10",
]
# PPO's critic at 10x the actor's rate, the released run's ratio (1e-5 against 1e-6), at the demo's actor rate.
PPO_FLAGS = ["--critic-lr", "2e-3"]


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def warm_up(out: Path, seed: int, model_type: str = "qwen2") -> Path:
    """Tokenizer + tiny model (``DEMO_MODELS[model_type]``) + supervised warm-up; reused when ``out/warm`` already
    holds one of that type.

    Raises:
        ValueError: naming ``--model-type`` and ``--out`` when ``out/warm`` holds a model of another type.
    """
    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.demo import task as demo_task
    from megatron_pacs.demo.sft import sft_warmup
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel

    warm = out / "warm"
    if (warm / "config.json").is_file() and (warm / "model.safetensors").is_file():
        found = json.loads((warm / "config.json").read_text()).get("model_type")
        if found != model_type:
            raise ValueError(f"--model-type {model_type}: {warm} holds a {found} model; pass another --out")
        log.info("demo: reusing the warmed-up model in %s", warm)
        return warm
    base = out / "base"
    tok = build_tokenizer(
        demo_task.DEMO_MODEL["vocab_size"], corpus=demo_task.tokenizer_corpus(seed=seed), split_digits=True
    )
    config = tiny_hf_config(**demo_task.DEMO_MODELS[model_type])
    build_tiny_model(str(base), config, seed=seed, tokenizer=tok, perturb_norms=False)
    rows = demo_task.sft_rows(
        demo_task.make_problems(demo_task.DEMO_SFT_ROWS, seed=seed, split="train"),
        correct_prob=demo_task.DEMO_CORRECT_PROB,
        seed=seed,
    )
    eval_rows = demo_task.sft_rows(demo_task.make_problems(64, seed=seed, split="val"), correct_prob=1.0, seed=seed)
    groups = init_parallel(ParallelConfig(), seed=seed)
    started = time.perf_counter()
    result = sft_warmup(str(base), str(warm), rows, seed=seed, groups=groups, eval_rows=eval_rows, **demo_task.DEMO_SFT)
    destroy_parallel()
    losses = result.get("loss", [])
    if losses:
        estimates = result.get("sampled_acc_est") or [(0, float("nan"))]  # [(step, estimated T=1 accuracy)]
        acc = float(estimates[-1][-1])
        log.info(
            "demo: warm-up %d steps in %.0fs, loss %.3f -> %.3f, estimated T=1 accuracy %.2f",
            len(losses),
            time.perf_counter() - started,
            losses[0],
            losses[-1],
            acc,
        )
    return warm


def run_rl(
    model: Path, data: tuple[Path, Path], run_dir: Path, loss: str, steps: int, seed: int, extra: list[str]
) -> list[float]:
    """Train ``model`` with ``loss`` (and trainer flags ``extra``) for ``steps`` steps; returns the per-step mean
    rollout reward."""
    from transformers import AutoTokenizer

    from megatron_pacs.config import parse_config
    from megatron_pacs.data.loader import PromptLoader
    from megatron_pacs.data.prepare import load_prompts
    from megatron_pacs.trainer import Trainer

    flags = [
        *RL_FLAGS,
        "--hf-model",
        str(model),
        "--train-data",
        str(data[0]),
        "--val-data",
        str(data[1]),
        "--train-iters",
        str(steps),
        "--seed",
        str(seed),
        "--loss",
        loss,
        "--log-dir",
        str(run_dir),
        *extra,
    ]
    cfg = parse_config(flags)
    cfg.validate(1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_model)
    train_rows, val_rows, dropped = load_prompts(cfg.data, tokenizer, cfg.batch.max_prompt_length)
    loader = PromptLoader(train_rows, cfg.batch.global_batch_size, seed=seed, dropped=dropped)
    with Trainer(cfg, val_rows) as trainer:
        history = trainer.fit(loader)
    return [m["rollout/reward_mean"] for m in history]


def _ascii_curve(rewards: list[float], width: int = 40) -> str:
    lines = []
    for i, r in enumerate(rewards, 1):
        lines.append(f"  step {i:3d} {r:5.3f} " + "#" * round(r * width))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megatron_pacs.demo import task as demo_task

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="run folder (default runs/demo, or runs/demo-compare)")
    p.add_argument("--steps", type=int, default=30, help="RL steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--compare", action="store_true", help="train PACS, GRPO and PPO from the same warm-up and plot all three"
    )
    p.add_argument(
        "--model-type",
        choices=sorted(demo_task.DEMO_MODELS),
        default="qwen2",
        help="the tiny model: a Qwen2-style dense model, or a Qwen3-MoE (8 experts, top-2)",
    )
    p.add_argument(
        "train_flags",
        nargs=argparse.REMAINDER,
        help="after --: more trainer flags, e.g. -- --pacs-score-reference ref --ref-reset-interval 10",
    )
    args = p.parse_args(argv)
    extra = [f for f in args.train_flags if f != "--"]
    if args.steps < 10:
        p.error("--steps must be >= 10 (the summary compares the first and last 5 steps)")
    started = time.perf_counter()
    out = Path(args.out or ("runs/demo-compare" if args.compare else "runs/demo"))
    out.mkdir(parents=True, exist_ok=True)
    data = (out / "train.jsonl", out / "val.jsonl")
    _write_jsonl(demo_task.make_problems(640, seed=args.seed, split="train"), data[0])
    _write_jsonl(demo_task.make_problems(64, seed=args.seed, split="val"), data[1])
    try:
        model = warm_up(out, args.seed, args.model_type)
    except ValueError as e:
        p.error(str(e))

    summary: dict = {}
    for loss in ("pacs", "grpo", "ppo") if args.compare else ("pacs",):
        run_dir = out / loss
        if run_dir.exists():  # the previous demo's run: its metrics and dumps would mix with this one's
            log.info("demo: removing the previous run in %s (each demo run starts afresh)", run_dir)
            shutil.rmtree(run_dir)
        own = PPO_FLAGS if loss == "ppo" else []
        rewards = run_rl(model, data, run_dir, loss, args.steps, args.seed, [*own, *extra])
        first5, last5 = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        summary[loss] = {"first5_reward_mean": first5, "last5_reward_mean": last5, "rewards": rewards}
        print(f"\n{loss.upper()} reward per step (mean over the step's rollouts):\n{_ascii_curve(rewards)}")
        print(f"{loss.upper()}: first 5 steps {first5:.3f} -> last 5 steps {last5:.3f}")

    from megatron_pacs.utils.plot import plot_runs

    labels = list(summary)
    plot_runs(
        [out / loss for loss in labels],
        out / "reward_curve.png",
        keys=["rollout/reward_mean"],
        labels=[label.upper() for label in labels],
    )
    main_run = summary["pacs"]
    result = {
        "first5_reward_mean": main_run["first5_reward_mean"],
        "last5_reward_mean": main_run["last5_reward_mean"],
        "wall_s": time.perf_counter() - started,
        "steps": args.steps,
        "model_type": args.model_type,
        "train_flags": extra,
        "runs": summary,
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'summary.json'} and {out / 'reward_curve.png'} (wall {result['wall_s']:.0f}s)")
    return 0
