#!/usr/bin/env python
"""The training step on a realistic RL length mix: padded vs packed micro-batches, against HF transformers.

A step's batch: P prompts (~200 tokens) x 8 responses each, response lengths log-normal with median 1,500 and a
tail clipped at 8,192 (the length mix of long-CoT RLVR). Variants, each in a fresh process (clean peak memory):

- ``hf``: Hugging Face transformers forward + backward on the padded micro-batches (SDPA attention, its own loss;
  padded only: its SDPA path cannot confine attention to the sequences of a packed row).
- ``fwd_bwd``: our Megatron model, forward + backward through Megatron's schedule, with no optimizer and no DDP
  (gradients in the parameters' dtype, as HF's): the model's own cost, comparable with ``hf`` in time and memory.
- ``train``: our full step, ``update_policy`` with the PACS objective (forward, backward, optimizer step).
- ``logprobs``: our forward-only token log-probs over every micro-batch (``Actor.logprobs``: the old, reference
  and phase-1 passes of a step), no backward.
- ``host`` (GPU): the host's share of one forward-only pass: time to enqueue it (Python: Megatron's layers, our
  attention and log-prob code) against the device time (CUDA events), per layer. Host-bound when enqueue >= device.

each ``padded`` (``--no-sequence-packing``: ``--micro-batch-size`` rows cut in order, padded to their longest row)
or ``packed`` (the default: one row per micro-batch, bin-packed into ``--micro-batch-size`` x ``--seq-length``
tokens, docs/algorithm.md §4.4). Both bound a micro-batch by the same worst case, so memory is compared fairly.
Throughput counts real tokens only; FLOPs are
the useful ones, ``6 N T + 12 L (heads d) sum_i s_i^2`` (PaLM/Megatron convention, full attention), so padding
shows up as lost MFU. MFU is against the GPU's dense bf16 peak (989 TFLOP/s on H100 and H200 SXM).

On GPU (default there): a random-init Qwen2.5-1.5B shape (``--shape 3b`` / ``7b`` too), bf16. On CPU (default
here): a tiny model and the same mix scaled down 16x, through the same code; the figure of merit is the
packed/padded ratio of tokens per second. ``--fp8 RECIPE [RECIPE ...]`` adds rows for our variants in Transformer
Engine FP8 (hybrid format) per recipe, each with its speed-up over the same variant and layout in bf16 ("vs bf16").
A 7B training state (fp32 master weights and Adam moments) does not fit one 80 GiB GPU: there, run
``--variants hf fwd_bwd logprobs``.

Usage:
  python benchmarks/bench_train_step.py                          # CPU: tiny, packed vs padded
  python benchmarks/bench_train_step.py --shape 1.5b             # GPU: hf, fwd_bwd, train x padded, packed
  python benchmarks/bench_train_step.py --shape 7b --variants hf fwd_bwd logprobs --layouts packed \
      --fp8 delayed tensorwise blockwise                         # GPU: the FP8 columns at 7B
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # Qwen2.5 shapes (HF config fields); "tiny" is a CPU stand-in.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def length_mix(prompts: int, group: int, scale: int, seed: int) -> list[tuple[int, int]]:
    """``(prompt_len, response_len)`` per response: prompts ~N(200, 40) in [64, 512], responses log-normal with
    median 1,500 and sigma 0.8 clipped to [16, 8192]; every length divided by ``scale``."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        p = min(max(int(rng.gauss(200, 40)), 64), 512) // scale
        for _ in range(group):
            r = min(max(int(rng.lognormvariate(math.log(1500), 0.8)), 16), 8192) // scale
            out.append((max(p, 2), max(r, 1)))
    return out


def useful_flops(shape: dict, lengths: list[int]) -> float:
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    n_matmul = layers * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * f) + shape["vocab_size"] * h
    return 6 * n_matmul * sum(lengths) + 12 * layers * heads * d * sum(s * s for s in lengths)


def make_model_dir(shape_name: str, root: Path) -> Path:
    """A random-init Qwen2 checkpoint of the shape (written once, bf16 on GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = root / f"qwen2_{shape_name}"
    if (path / "config.json").is_file():
        return path
    cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[shape_name])
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _batch(mix: list[tuple[int, int]], vocab: int, group: int):
    import torch

    from megatron_pacs.data.batching import RolloutBatch

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (p + r,), generator=g).tolist() for p, r in mix]
    rewards = (torch.rand(len(mix), generator=g) > 0.5).float()
    return RolloutBatch.from_sequences(
        seqs, torch.tensor([p for p, _ in mix]), torch.tensor([r for _, r in mix]), rewards, group_size=group
    )


def _timed(fn, warmup: int, iters: int) -> tuple[float, float]:
    """Median seconds per call and peak memory in GiB (CUDA allocator, or the process's peak RSS on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    return statistics.median(times), peak


def worker(args: argparse.Namespace) -> dict:
    import torch

    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.config import BatchConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_pacs.mcore.parallel import init_parallel
    from megatron_pacs.update import step_layout, update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    gpu = torch.cuda.is_available()
    shape = SHAPES[args.shape]
    mix = length_mix(args.prompts, args.group_size, args.scale, args.seed)
    max_prompt, max_response = 512 // args.scale, 8192 // args.scale
    batch = _batch(mix, shape["vocab_size"], args.group_size)
    bcfg = BatchConfig(
        global_batch_size=args.prompts,
        group_size=args.group_size,
        ppo_mini_batch_size=args.prompts,
        max_prompt_length=max_prompt,
        max_response_length=max_response,
        micro_batch_size=args.micro_batch_size,
        max_tokens_per_microbatch=args.max_tokens if args.layout == "packed" else None,
        sequence_packing=args.layout == "packed",
    )
    groups = init_parallel(ParallelConfig())
    model_dir = make_model_dir(args.shape, Path(args.workdir))
    fp8_recipe = None if args.precision == "bf16" else args.precision
    layout = step_layout(batch, bcfg, groups, whole_groups=False, align=16 if fp8_recipe else 1)
    mbs = layout.micro_batches([0])
    lengths = batch.lengths.tolist()
    processed = sum(mb.tokens.numel() for mb in mbs)
    if args.variant == "hf":
        step = _hf_step(model_dir, mbs, gpu)
    elif args.variant == "host":
        from megatron_pacs.mcore.actor import Actor

        actor = Actor(ModelConfig(hf_model=str(model_dir), bf16=gpu, transformer_impl=args.impl), groups, None)
        return {"variant": "host", "layout": args.layout, **_host_overhead(actor, mbs, shape, args)}
    else:
        from megatron_pacs.mcore.actor import Actor

        fp8 = {"fp8_format": "hybrid", "fp8_recipe": fp8_recipe} if fp8_recipe else {}
        model = ModelConfig(hf_model=str(model_dir), bf16=gpu, transformer_impl=args.impl, **fp8)
        optim = OptimConfig(lr=1e-7, use_distributed_optimizer=gpu) if args.variant == "train" else None
        actor = Actor(model, groups, optim)
        if args.variant == "fwd_bwd":
            step = _fwd_bwd_step(actor, mbs)
        elif args.variant == "logprobs":

            def step():
                actor.logprobs(mbs, batch.response_lens)
        else:
            objective = build_objective(LossConfig(), bcfg)

            def step():
                update_policy(actor, batch, objective, bcfg, groups, PhaseTimer(), temperature=1.0)

    seconds, peak = _timed(step, args.warmup, args.iters)
    flops = useful_flops(shape, lengths)
    # A forward is a third of forward + backward: its useful FLOPs are 2 N T + 4 L (heads d) sum s^2.
    flops = flops / 3 if args.variant == "logprobs" else flops
    out = {
        "variant": args.variant,
        "layout": args.layout,
        "precision": args.precision,
        "seconds": seconds,
        "tokens_per_s": sum(lengths) / seconds,
        "tflops": flops / seconds / 1e12,
        "peak_gib": peak,
        "padding": 1 - sum(lengths) / processed,
        "micro_batches": len(mbs),
        "tokens": sum(lengths),
    }
    if gpu:
        name = torch.cuda.get_device_name()
        peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)
        out["mfu"] = flops / seconds / peak_flops if peak_flops else None
        out["device"] = name
    return out


def _fwd_bwd_step(actor, mbs):
    import torch

    from megatron_pacs.mcore.forward import model_token_logprobs, run_schedule

    tp_group = actor.groups.tp_group

    def loss_fn(logits, mb):
        scored = mb.scored(model_token_logprobs(logits, mb, tp_group))
        return scored.logp.sum(), torch.tensor(scored.num_sequences, dtype=torch.int), {}

    for p in (p for m in actor.chunks for p in m.parameters()):
        p.requires_grad_(True)  # built frozen (no optimizer): gradients land in p.grad, in the weights' dtype

    def step():
        for m in actor.chunks:
            m.train()
            m.zero_grad(set_to_none=True)
        run_schedule(actor.chunks, mbs, loss_fn, forward_only=False)

    return step


def _host_overhead(actor, mbs, shape: dict, args: argparse.Namespace) -> dict:
    """Median host enqueue time and device time of a forward-only pass over the first micro-batch (ms)."""
    import torch

    from megatron_pacs.mcore.forward import run_schedule

    def loss_fn(logits, mb):
        return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

    host, device = [], []
    for i in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        t0 = time.perf_counter()
        with torch.no_grad():
            run_schedule(actor.chunks, mbs[:1], loss_fn, forward_only=True)
        enqueue = time.perf_counter() - t0
        end_event.record()
        end_event.synchronize()
        if i >= args.warmup:
            host.append(enqueue * 1e3)
            device.append(start_event.elapsed_time(end_event))
    layers = shape["num_hidden_layers"]
    return {
        "host_ms": statistics.median(host),
        "device_ms": statistics.median(device),
        "host_ms_per_layer": statistics.median(host) / layers,
        "tokens": int(mbs[0].tokens.numel()),
    }


def _hf_step(model_dir: Path, mbs, gpu: bool):
    """HF transformers forward + backward over the same micro-batches, with its own causal-LM loss."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda" if gpu else "cpu").train()
    device = next(model.parameters()).device
    inputs = []
    for mb in mbs:
        tokens = mb.tokens.to(device)
        labels = torch.where(mb.score_mask.to(device), tokens, -100)
        kwargs = {"input_ids": tokens, "labels": labels}
        kwargs["attention_mask"] = (mb.tokens != 0).long().to(device)
        inputs.append(kwargs)

    def step():
        model.zero_grad(set_to_none=True)
        for kwargs in inputs:
            model(**kwargs).loss.backward()

    return step


def run_variant(args: argparse.Namespace, variant: str, layout: str, precision: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--layout", layout, "--precision", precision]
    names = ("shape", "prompts", "group_size", "scale", "seed", "micro_batch_size", "max_tokens", "impl")
    for name in (*names, "workdir"):
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    cmd += ["--warmup", str(args.warmup), "--iters", str(args.iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {
            "variant": variant,
            "layout": layout,
            "precision": precision,
            "error": (proc.stderr or proc.stdout)[-1500:],
        }
    return json.loads(lines[-1])


def _error_line(text: str) -> str:
    """The line of a failed worker's output that names the error: its exception (``...Error: ...``, e.g. CUDA out
    of memory), not the last line, which on CUDA is often NCCL's exit warning about ``destroy_process_group``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or ["(no output)"])[-1]


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    host = [r for r in rows if r["variant"] == "host" and "error" not in r]
    rows = [r for r in rows if r["variant"] != "host" or "error" in r]
    ok = [r for r in rows if "error" not in r]
    base = {(r["variant"], r["precision"]): r for r in ok if r["layout"] == "padded"}
    bf16 = {(r["variant"], r["layout"]): r for r in ok if r["precision"] == "bf16"}
    hf = next((r for r in ok if r["variant"] == "hf"), None)
    print(
        f"train step, {args.shape} shape, {args.prompts} prompts x {args.group_size} responses, length mix / "
        f"{args.scale}, micro-batch {args.micro_batch_size} rows (padded) or their worst-case tokens (packed)"
        f"{', FP8 (hybrid) ' + ' '.join(args.fp8) if args.fp8 else ''}"
    )
    header = (
        "| variant | layout | precision | ms/step | tokens/s | TFLOP/s | MFU | peak GiB | padding | vs padded | "
        "vs bf16 | MFU vs hf |"
    )
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['layout']} | {r['precision']} | failed: {_error_line(r['error'])[:160]} |")
            continue
        padded = base.get((r["variant"], r["precision"]))
        vs_padded = f"{r['tokens_per_s'] / padded['tokens_per_s']:.2f}x" if padded else "-"
        ref = bf16.get((r["variant"], r["layout"]))
        vs_bf16 = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref and r["precision"] != "bf16" else "-"
        mfu = r.get("mfu")
        vs_hf = f"{mfu / hf['mfu']:.2f}x" if mfu and hf and hf.get("mfu") else "-"
        print(
            f"| {r['variant']} | {r['layout']} | {r['precision'] if r.get('device') else 'fp32'} | "
            f"{r['seconds'] * 1e3:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {'-' if mfu is None else f'{mfu:.1%}'} | "
            f"{r['peak_gib']:.1f} | {r['padding']:.1%} | {vs_padded} | {vs_bf16} | {vs_hf} |"
        )
    dev = next((r.get("device") for r in rows if r.get("device")), "CPU")
    print(
        f"device: {dev}; baselines: 'vs padded' = the same variant and precision padded, 'vs bf16' = the same "
        "variant and layout in bf16, 'MFU vs hf' = HF fwd+bwd (first row); MFU in bf16-peak terms"
    )
    if host:
        print("\nhost overhead of one forward-only micro-batch (enqueue vs device time)")
        print("| layout | tokens | host ms | device ms | host ms / layer | host-bound |")
        print("|---|---|---|---|---|---|")
        for r in host:
            bound = "yes" if r["host_ms"] >= r["device_ms"] else "no"
            print(
                f"| {r['layout']} | {r['tokens']} | {r['host_ms']:.1f} | {r['device_ms']:.1f} | "
                f"{r['host_ms_per_layer']:.2f} | {bound} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import torch

    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b" if gpu else "tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--scale", type=int, default=1 if gpu else 16, help="divide every length by this (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro-batch-size", type=int, default=2 if gpu else 8, help="padded rows per micro-batch")
    ap.add_argument("--max-tokens", type=int, default=None, help="packed budget (default: rows x max sequence)")
    ap.add_argument("--impl", default="auto", help="layer spec: auto, te, sdpa or local")
    ap.add_argument(
        "--fp8", nargs="*", default=[], help="FP8 recipes to add for our variants (delayed, tensorwise, blockwise)"
    )
    ap.add_argument(
        "--variants", nargs="+", default=["hf", "fwd_bwd", "train", "host"] if gpu else ["fwd_bwd", "train"]
    )
    ap.add_argument("--layouts", nargs="+", default=["padded", "packed"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mpacs_bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    # HF's SDPA path cannot confine attention to each sequence of a packed row: it runs padded only, whatever
    # --layouts says (it is the named baseline of every row).
    runs = [(v, lay) for v in args.variants for lay in (["padded"] if v == "hf" else args.layouts)]
    ours = ["bf16", *args.fp8]
    rows = [run_variant(args, v, lay, p) for v, lay in runs for p in (["bf16"] if v in ("hf", "host") else ours)]
    print_table(rows, args)


if __name__ == "__main__":
    main()
