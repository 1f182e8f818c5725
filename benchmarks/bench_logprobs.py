#!/usr/bin/env python
"""Token log-probs at Qwen's vocabulary: ours (chunked or fused, vocab-parallel) vs the naive full-vocabulary path.

Baseline: ``torch.log_softmax(logits.float(), -1).gather(...)`` on the full ``[T, V]`` logits (at TP=2 the
shards are first all-gathered, as code without a vocab-parallel log-prob must). Ours:
``vocab_parallel_logprobs`` on the ``[T, V/TP]`` shard, ``impl="chunked"`` (torch) and, on CUDA,
``impl="fused"`` (the Triton kernels). All run forward + backward on bf16 logits (T = 4,096, V = 151,936).

CPU (default): each variant runs in a fresh process; peak memory is the rise of the peak RSS (reset once the inputs
exist) over the RSS at that point; TP=2 runs two gloo ranks (rank 0 reported). ``--device cuda``: TP=1 in one
process, the median of ``--iters`` timed runs (CUDA events) after a warm-up, peak memory from
``torch.cuda.max_memory_allocated`` above the inputs; Megatron's ``vocab_parallel_cross_entropy`` is a further row.

Usage: python benchmarks/bench_logprobs.py [--device cpu|cuda] [--tokens 4096] [--vocab 151936] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM), so input set-up does not count.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs

    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if tp > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    rank = dist.get_rank() if tp > 1 else 0
    g = torch.Generator().manual_seed(rank)
    shard = (torch.randn(args.tokens, args.vocab // tp, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(1))
    base = _rss_mb()
    _reset_peak()
    t0 = time.perf_counter()
    if args.impl == "chunked":
        logp = vocab_parallel_logprobs(shard, labels, group, chunk_size=args.chunk, impl="chunked")
    else:
        full = shard
        if tp > 1:
            parts = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(parts, shard.detach())
            parts[rank] = shard  # keep the autograd path through this rank's shard
            full = torch.cat(parts, -1)
        logp = torch.log_softmax(full.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    logp.sum().backward()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"time_s": elapsed, "peak_mb": max(_peak_mb() - base, 0.0)}))
    if tp > 1:
        dist.destroy_process_group()


def _cuda_step(impl: str, shard, labels, chunk: int):
    import torch

    from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs

    if impl == "naive":
        logp = torch.log_softmax(shard.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    elif impl == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # [s, b, V] in, [s, b] loss out; needs Megatron's parallel state (a 1-rank group, set up in cuda_table).
        logp = -vocab_parallel_cross_entropy(shard[:, None], labels[:, None])[:, 0]
    else:
        logp = vocab_parallel_logprobs(shard, labels, None, chunk_size=chunk, impl=impl)
    logp.sum().backward()


def _megatron_state() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel()


def cuda_table(args) -> None:
    import torch

    _megatron_state()
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(args.tokens, args.vocab, generator=g, device="cuda") * 3
    shard = base.to(torch.bfloat16).requires_grad_(True)
    del base
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    name = torch.cuda.get_device_name()
    print(f"token log-probs, forward + backward, bf16 logits, T={args.tokens}, V={args.vocab}, {name}, TP=1")
    print("| implementation | median ms | peak extra MiB | time ratio vs naive | memory ratio vs naive |")
    print("|---|---|---|---|---|")
    rows = {}
    for impl in ("naive", "megatron", "chunked", "fused"):
        try:
            _cuda_step(impl, shard, labels, args.chunk)  # warm-up (and Triton's compile)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, the others still run
            print(f"| {impl} | failed: {type(exc).__name__}: {exc} | | | |")
            continue
        shard.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_mem = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _cuda_step(impl, shard, labels, args.chunk)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            shard.grad = None
        peak = (torch.cuda.max_memory_allocated() - start_mem) / 2**20
        rows[impl] = (sorted(times)[len(times) // 2], peak)
    naive_ms, naive_mb = rows.get("naive", (float("nan"), float("nan")))
    for impl, (ms, mb) in rows.items():
        print(f"| {impl} | {ms:.2f} | {mb:.0f} | {ms / naive_ms:.2f}x | {mb / naive_mb:.2f}x |")


def run(impl: str, tp: int, args) -> dict:
    me = [
        os.path.abspath(__file__),
        "--worker",
        "--impl",
        impl,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--chunk",
        str(args.chunk),
    ]
    if tp == 1:
        cmd = [sys.executable, *me]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", f"--master-port={port}", *me]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per row on CUDA (median reported)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=["chunked", "naive"], default="chunked", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.device == "cuda":
        cuda_table(args)
        return
    print(f"token log-probs, forward + backward, bf16 logits, T={args.tokens}, V={args.vocab}, CPU, 1 thread/rank")
    print(
        f"| {'TP':>2} | {'implementation':<42} | {'peak extra MB':>13} | {'time s':>7} | {'memory ratio':>12} | "
        f"{'speed ratio':>11} |"
    )
    print(f"|{'-' * 4}|{'-' * 44}|{'-' * 15}|{'-' * 9}|{'-' * 14}|{'-' * 13}|")
    for tp in (1, 2):
        naive, ours = run("naive", tp, args), run("chunked", tp, args)
        rows = [("baseline: log_softmax(full.float()).gather", naive), (f"ours: chunked ({args.chunk} tokens)", ours)]
        for label, r in rows:
            mem = naive["peak_mb"] / max(r["peak_mb"], 1e-9)
            speed = naive["time_s"] / r["time_s"]
            print(
                f"| {tp:>2} | {label:<42} | {r['peak_mb']:>13.0f} | {r['time_s']:>7.2f} | {mem:>11.1f}x | "
                f"{speed:>10.2f}x |"
            )
    print("(the fused Triton kernels run on CUDA only: --device cuda)")


if __name__ == "__main__":
    main()
