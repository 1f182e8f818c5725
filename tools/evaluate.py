#!/usr/bin/env python
"""pass@k evaluation of a Hugging Face model directory with the PACS protocol, on the vLLM fleet.

Defaults follow docs/algorithm.md §8.3: temperature 0.6, top_p 0.95, 4,096 new tokens; k = powers of two up to n.
The fleet and reward flags are the trainer's own (``--num-engines``, ``--rollout-tensor-parallel-size``,
``--ray-address``, ``--reward-workers``, ...: :class:`megatron_pacs.config.RolloutConfig` and ``RewardConfig``).
Writes, under --out: eval_settings.json (the model, n and sampling settings), eval_rollout.jsonl (one line per
problem: fields, responses, scores), eval_metrics.json ({data_source: {"pass@1": ..., ...}}), eval_metrics.md and
eval_passk.png. Re-running with the same --out and settings skips the problems already recorded; with other
settings it is refused naming what differs (--overwrite starts afresh).

Examples:
    # a model converted with tools/convert_checkpoint.py mcore-to-hf, on the four evaluation sets, n = 32
    python tools/evaluate.py --model hf/qwen7b-step300 --data data/math500.jsonl data/aime2024.jsonl \\
        data/aime2025.jsonl data/amc23.jsonl --n 32 --out eval/step300 --num-engines 8 --rollout-tensor-parallel-size 1
    # on an existing Ray cluster
    python tools/evaluate.py --model ... --data ... --n 256 --out ... --ray-address auto --num-engines 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_pacs.config import RewardConfig, RolloutConfig, add_section_flags, section_from_args

#: The fleet's flags this tool takes (the trainer's sampling, overlap, weight-sync and consistency flags it does not).
FLEET_FLAGS = (
    "rollout_backend",
    "num_engines",
    "rollout_tensor_parallel_size",
    "rollout_engine_kwargs",
    "ray_address",
    "ray_object_store_gb",
    "gpu_memory_utilization",
    "kv_cache_gb",
    "chunks_per_engine",
    "max_engine_restarts",
    "engine_call_timeout_seconds",
)
#: The reward pool's flags this tool takes.
REWARD_FLAGS = ("reward_workers", "reward_timeout", "reward_max_chars")
SETTINGS_FILE = "eval_settings.json"
#: What an --out holds of one evaluation (--overwrite removes these, and nothing else).
RESULT_FILES = (SETTINGS_FILE, "eval_rollout.jsonl", "eval_metrics.json", "eval_metrics.md", "eval_passk.png")


def _only(cls: type, used: tuple[str, ...]) -> tuple[str, ...]:
    """The fields of ``cls`` outside ``used`` (left out of the parser: they keep their defaults)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in used)


def model_dtype(model: str) -> str:
    """The dtype a model's config.json states (``torch_dtype``, or transformers 5's ``dtype``); float32 where it
    states none (transformers' default). vLLM's own ``auto`` would run a float32 checkpoint in half precision."""
    with open(Path(model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What the results in --out depend on: the model, n and the sampling settings."""
    return {
        "model": str(Path(args.model).resolve()),
        "n": args.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
    }


def settings_conflict(out: str, settings: dict[str, Any]) -> str | None:
    """Why --out's recorded results are not of ``settings`` (each field that differs), or None where they are, where
    it holds no results, or where its results predate the record (taken as this run's)."""
    path = Path(out, SETTINGS_FILE)
    if not path.is_file() or not Path(out, "eval_rollout.jsonl").is_file():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return f"{path} is not valid JSON ({exc})"
    differ = [f"{k}: {recorded.get(k)!r} there, {v!r} here" for k, v in settings.items() if recorded.get(k) != v]
    return "; ".join(differ) or None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (config, tokenizer, safetensors)")
    p.add_argument("--data", required=True, nargs="+", help="prepared datasets (.jsonl/.json/.parquet)")
    p.add_argument("--n", type=int, required=True, help="samples per problem")
    p.add_argument("--out", required=True, help="output directory (resumed if it holds eval_rollout.jsonl)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=4096, help="maximum new tokens per sample")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (sample j of problem i uses seed + i*n + j)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--batch-size", type=int, default=256, help="problems per generation call (resume unit)")
    p.add_argument("--no-plot", action="store_true", help="skip eval_passk.png")
    p.add_argument(
        "--rollout-dtype",
        "--dtype",
        dest="dtype",
        default="auto",
        help="engine dtype: float32, bfloat16, float16, or auto: the model's (config.json's torch_dtype; float32 "
        "where it states none)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"start afresh in an --out that holds results of other settings (removes its {', '.join(RESULT_FILES)})",
    )
    add_section_flags(p, "rollout", RolloutConfig, exclude=_only(RolloutConfig, FLEET_FLAGS))
    add_section_flags(p, "reward", RewardConfig, exclude=_only(RewardConfig, REWARD_FLAGS))
    args = p.parse_args(argv)
    try:
        args.fleet = section_from_args(args, "rollout", RolloutConfig)
        args.rewards = section_from_args(args, "reward", RewardConfig)
    except ValueError as exc:
        p.error(str(exc))
    if args.n < 1:
        p.error(f"--n {args.n}: draw at least one sample per problem")
    if not Path(args.model, "config.json").exists():
        p.error(f"--model {args.model}: no config.json there; pass a HF model directory")
    for f in args.data:
        if not Path(f).exists():
            p.error(f"--data {f}: no such file; prepare it with tools/prepare_data.py")
    if args.dtype == "auto":
        args.dtype = model_dtype(args.model)
    args.settings = settings_of(args)
    conflict = settings_conflict(args.out, args.settings)
    if conflict is not None and not args.overwrite:
        p.error(
            f"--out {args.out} holds the results of other settings ({conflict}); evaluate into another --out, or "
            "add --overwrite to remove those results and start afresh"
        )
    return args


def _start(out: str, settings: dict[str, Any], *, overwrite: bool) -> None:
    """With ``overwrite`` remove --out's results; then record ``settings`` there (atomically)."""
    folder = Path(out)
    if overwrite:
        for name in RESULT_FILES:
            (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (SETTINGS_FILE + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / SETTINGS_FILE)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_pacs.data.formats import read_prompt_rows
    from megatron_pacs.data.tokenizer import load_checked_tokenizer
    from megatron_pacs.evaluation import evaluate, pending_rows
    from megatron_pacs.rewards.scorer import RewardScorer
    from megatron_pacs.rollout.fleet import RolloutFleet
    from megatron_pacs.rollout.types import SamplingConfig

    rows = [row for f in args.data for row in read_prompt_rows(f)[0]]
    try:  # a missing or empty tokenizer would evaluate empty prompts
        tokenizer = load_checked_tokenizer(args.model, "--model")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _start(args.out, args.settings, overwrite=args.overwrite)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingConfig(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop_token_ids=eos,
        logprobs=False,
    )
    fleet = None
    if pending_rows(rows, args.out):  # a finished run only recomputes its metrics: no engine needed
        fleet = RolloutFleet(
            args.fleet,
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            run_dir=args.out,
        )
    try:
        rw = args.rewards
        with RewardScorer(
            num_workers=rw.reward_workers, timeout_s=rw.reward_timeout, max_chars=rw.reward_max_chars or None
        ) as scorer:
            metrics = evaluate(
                fleet,
                tokenizer,
                rows,
                args.out,
                sampling,
                scorer=scorer,
                batch_size=args.batch_size,
                plot=not args.no_plot,
            )
    finally:
        if fleet is not None:
            fleet.shutdown()
    print(Path(args.out, "eval_metrics.md").read_text(encoding="utf-8"))
    return 0 if metrics else 1


if __name__ == "__main__":
    sys.exit(main())
