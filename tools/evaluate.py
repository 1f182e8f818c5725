#!/usr/bin/env python
"""pass@k evaluation of a Hugging Face model directory with the PACS protocol, on the vLLM fleet.

Defaults follow docs/algorithm.md §8.3: temperature 0.6, top_p 0.95, 4,096 new tokens; k = powers of two up to n.
The fleet and reward flags are the trainer's own (``--num-engines``, ``--rollout-tensor-parallel-size``,
``--ray-address``, ``--reward-workers``, ...: :class:`megatron_pacs.config.RolloutConfig` and ``RewardConfig``).
Writes, under --out: eval_rollout.jsonl (one line per problem: fields, responses, scores), eval_metrics.json
({data_source: {"pass@1": ..., ...}}), eval_metrics.md and eval_passk.png. Re-running with the same --out skips
the problems already recorded.

Examples:
    # a model converted with tools/convert_checkpoint.py mcore-to-hf, on the four evaluation sets, n = 32
    python tools/evaluate.py --model hf/qwen7b-step300 --data data/math500.jsonl data/aime2024.jsonl \\
        data/aime2025.jsonl data/amc23.jsonl --n 32 --out eval/step300 --num-engines 8 --rollout-tensor-parallel-size 1
    # on an existing Ray cluster
    python tools/evaluate.py --model ... --data ... --n 256 --out ... --ray-address auto --num-engines 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_pacs.config import RewardConfig, RolloutConfig, add_section_flags, section_from_args


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
    add_section_flags(p, "rollout", RolloutConfig, exclude=("temperature", "top_p", "top_k"))
    add_section_flags(p, "reward", RewardConfig)
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_pacs.data.formats import read_prompt_rows
    from megatron_pacs.evaluation import evaluate, pending_rows
    from megatron_pacs.rewards.scorer import RewardScorer
    from megatron_pacs.rollout.fleet import RolloutFleet
    from megatron_pacs.rollout.types import SamplingConfig

    rows = [row for f in args.data for row in read_prompt_rows(f)[0]]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
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
            dtype=args.fleet.rollout_dtype,
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
