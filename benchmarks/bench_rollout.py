#!/usr/bin/env python
"""Rollout benchmark: generation throughput, weight-sync cost, and the Ray actor's overhead, as one table.

Baselines measured in the same run:
- generation: the same vLLM engine in this process (no Ray) vs the fleet's Ray actor;
- weight sync: the naive route (write safetensors to disk, the engine reloads from the path) vs the fleet's
  bucketed in-memory push through the object store, and the in-process push.

    python benchmarks/bench_rollout.py [--hidden 256 --layers 4 --vocab 2048 --prompts 32 --n 8 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _model(root: str, args: argparse.Namespace, seed: int) -> str:
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=args.vocab)
    cfg = tiny_hf_config(
        "qwen2",
        vocab_size=len(tok),
        hidden=args.hidden,
        layers=args.layers,
        heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 128),
        tied=False,
    )
    path = os.path.join(root, f"model_{seed}")
    build_tiny_model(path, cfg, seed=seed, tokenizer=tok)
    return path


def _state(path: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(os.path.join(path, "model.safetensors")).items())


def _gen(engine, prompts, sampling, repeats: int) -> float:
    engine.generate(prompts[:2], sampling)  # warm-up
    started = time.perf_counter()
    tokens = 0
    for _ in range(repeats):
        tokens += sum(len(r.token_ids) for g in engine.generate(prompts, sampling) for r in g.responses)
    return tokens / (time.perf_counter() - started)


def _timed(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from megatron_pacs.data.prompts import apply_chat_template
    from megatron_pacs.rollout.types import SamplingConfig

    root = tempfile.mkdtemp(prefix="bench_rollout_")
    path_a, path_b = _model(root, args, 0), _model(root, args, 1)
    tok = AutoTokenizer.from_pretrained(path_a)
    prompts = [
        apply_chat_template(tok, [{"role": "user", "content": f"What is {i} * {i + 7}?"}]) for i in range(args.prompts)
    ]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    state_b = _state(path_b)
    megabytes = sum(t.numel() * t.element_size() for _, t in state_b) / 2**20
    rows = []

    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    engine = VLLMEngine(path_a, dtype="float32", max_model_len=512)
    local_tps = _gen(engine, prompts, sampling, args.repeats)

    def via_disk() -> None:
        from safetensors.torch import save_file

        out = os.path.join(root, "sync_dir")
        os.makedirs(out, exist_ok=True)
        save_file(dict(state_b), os.path.join(out, "model.safetensors"))
        for f in ("config.json",):
            os.link(os.path.join(path_b, f), os.path.join(out, f)) if not os.path.exists(os.path.join(out, f)) else None
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": out, "is_checkpoint_format": True})
        engine.llm.reset_prefix_cache()

    disk_s = _timed(via_disk, args.repeats)
    inproc_s = _timed(lambda: engine.update_weights(state_b, bucket_bytes=64 << 20), args.repeats)
    engine.shutdown()

    from megatron_pacs.config import RolloutConfig
    from megatron_pacs.rollout.fleet import RolloutFleet

    fleet = RolloutFleet(
        RolloutConfig(weight_sync_bucket_mb=64),
        model=path_a,
        dtype="float32",
        max_model_len=512,
        run_dir=root,
        progress=False,
    )
    try:
        ray_tps = _gen(fleet, prompts, sampling, args.repeats)
        fleet_s = _timed(lambda: fleet.update_weights(state_b), args.repeats)
    finally:
        fleet.shutdown()

    rows.append(
        (
            f"generation tok/s (1 engine, n={args.n}, {args.max_tokens} new tokens)",
            f"in-process: {local_tps:,.0f}",
            f"Ray actor: {ray_tps:,.0f}",
            f"{ray_tps / local_tps:.2f}x",
        )
    )
    rows.append(
        (
            f"weight sync ({megabytes:.1f} MB, fp32)",
            f"disk reload: {disk_s / megabytes * 1e3:.2f} ms/MB",
            f"fleet (object store): {fleet_s / megabytes * 1e3:.2f} ms/MB",
            f"{disk_s / fleet_s:.2f}x faster",
        )
    )
    rows.append(
        (
            "weight sync, Ray overhead",
            f"in-process push: {inproc_s / megabytes * 1e3:.2f} ms/MB",
            f"fleet (object store): {fleet_s / megabytes * 1e3:.2f} ms/MB",
            f"{fleet_s / inproc_s:.2f}x",
        )
    )
    print(f"\nbench_rollout: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.prompts} prompts")
    print("| measurement | baseline (same run) | ours | ratio |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
