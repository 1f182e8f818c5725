#!/usr/bin/env python
"""Token log-probs at Qwen's vocabulary: ours (chunked, vocab-parallel) vs the naive full-vocabulary path.

Baseline: ``torch.log_softmax(logits.float(), -1).gather(...)`` on the full ``[T, V]`` logits (at TP=2 the
shards are first all-gathered, as code without a vocab-parallel log-prob must). Ours:
``vocab_parallel_logprobs`` on the ``[T, V/TP]`` shard. Both run forward + backward on bf16 logits
(T = 4,096, V = 151,936). Each variant runs in a fresh process; peak memory is the rise of the peak
RSS (reset once the inputs exist) over the RSS at that point. TP=2 runs two gloo ranks (rank 0 reported).

Usage: python benchmarks/bench_logprobs.py [--tokens 4096] [--vocab 151936] [--chunk 512]
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
    if args.impl == "ours":
        logp = vocab_parallel_logprobs(shard, labels, group, chunk_size=args.chunk)
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
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=["ours", "naive"], default="ours", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"token log-probs, forward + backward, bf16 logits, T={args.tokens}, V={args.vocab}, CPU, 1 thread/rank")
    print(
        f"| {'TP':>2} | {'implementation':<42} | {'peak extra MB':>13} | {'time s':>7} | {'memory ratio':>12} | "
        f"{'speed ratio':>11} |"
    )
    print(f"|{'-' * 4}|{'-' * 44}|{'-' * 15}|{'-' * 9}|{'-' * 14}|{'-' * 13}|")
    for tp in (1, 2):
        naive, ours = run("naive", tp, args), run("ours", tp, args)
        rows = [("baseline: log_softmax(full.float()).gather", naive), (f"ours: chunked ({args.chunk} tokens)", ours)]
        for label, r in rows:
            mem = naive["peak_mb"] / max(r["peak_mb"], 1e-9)
            speed = naive["time_s"] / r["time_s"]
            print(
                f"| {tp:>2} | {label:<42} | {r['peak_mb']:>13.0f} | {r['time_s']:>7.2f} | {mem:>11.1f}x | "
                f"{speed:>10.2f}x |"
            )


if __name__ == "__main__":
    main()
