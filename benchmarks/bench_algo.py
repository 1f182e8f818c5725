#!/usr/bin/env python
"""Benchmark the algorithm core against baselines measured in the same run.

(a) ``pacs_loss`` forward+backward (rloo, balanced weights) at S = 8,192 responses, n = 8, against a loop
    implementation of the reference semantics: one micro-batch per group, weights from a Python loop over the
    group's labels, ``BCEWithLogitsLoss(weight)`` mean per group, averaged (what the reference's loss/GA does).
(b) ``RewardScorer`` on the 500 MATH-500 gold answers written as ``\\boxed{...}`` responses: a warm process pool
    against serial scoring in one process. Every answer must score 1.0.

Usage: python benchmarks/bench_algo.py [--responses 8192] [--group-size 8] [--data ../shared/data/math500.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from megatron_pacs.algo import pacs_loss
from megatron_pacs.rewards import RewardScorer

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


def reference_loop_loss(seq_logp, seq_old_logp, rewards, n, beta):
    """The reference's per-group computation (docs/algorithm.md §9.1), one group per micro-batch."""
    num_groups = seq_logp.shape[0] // n
    total = seq_logp.new_zeros(())
    for g in range(num_groups):
        sl = slice(g * n, (g + 1) * n)
        score = beta * (seq_logp[sl] - seq_old_logp[sl])
        adv = score - (score.sum() - score) / (n - 1)
        labels = rewards[sl].tolist()  # a host sync per group, as in the reference's compute_weight
        k = sum(1 for x in labels if x == 1)
        weight = torch.ones(n, dtype=seq_logp.dtype)
        if 0 < k < n:
            for i, x in enumerate(labels):
                weight[i] = n / (2 * k) if x == 1 else n / (2 * (n - k))
        loss_fn = torch.nn.BCEWithLogitsLoss(weight=weight)
        total = total + loss_fn(adv, rewards[sl]) / num_groups
    return total


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_loss(num_responses, n, repeats):
    g = torch.Generator().manual_seed(0)
    seq = torch.randn(num_responses, generator=g) * 5
    old = seq + torch.randn(num_responses, generator=g)
    rewards = (torch.rand(num_responses, generator=g) > 0.6).float()
    x_ours = seq.clone().requires_grad_(True)
    x_ref = seq.clone().requires_grad_(True)

    def ours():
        x_ours.grad = None
        pacs_loss(x_ours, old, rewards, group_size=n, beta=1.0).loss.backward()

    def ref():
        x_ref.grad = None
        reference_loop_loss(x_ref, old, rewards, n, 1.0).backward()

    t_ours, t_ref = timed(ours, repeats), timed(ref, max(1, repeats // 3))
    with torch.no_grad():
        l_ours = pacs_loss(seq, old, rewards, group_size=n).loss
        l_ref = reference_loop_loss(seq, old, rewards, n, 1.0)
    diff = max((l_ours - l_ref).abs().item(), (x_ours.grad - x_ref.grad).abs().max().item())
    return t_ours, t_ref, diff


def bench_rewards(data_path, workers):
    rows = [json.loads(line) for line in open(data_path, encoding="utf-8")]
    responses = [f"The final answer is $\\boxed{{{r['answer']}}}$." for r in rows]
    truths = [r["answer"] for r in rows]
    with RewardScorer(num_workers=0) as serial:
        serial.score(responses[:2], truths[:2])  # import + build the verifier outside the timing
        t0 = time.perf_counter()
        s_out = serial.score(responses, truths)
        t_serial = time.perf_counter() - t0
    with RewardScorer(num_workers=workers) as pool:
        t0 = time.perf_counter()
        pool.score(responses[:workers], truths[:workers])
        t_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        p_out = pool.score(responses, truths)
        t_pool = time.perf_counter() - t0
    return len(rows), t_serial, t_pool, t_start, sum(s_out.scores), sum(p_out.scores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=8192)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    t_ours, t_ref, diff = bench_loss(args.responses, args.group_size, args.repeats)
    print(f"\n(a) PACS loss fwd+bwd, S={args.responses}, n={args.group_size}, rloo + balanced, fp32, 1 thread")
    print(f"| {'implementation':<44} | {'time (ms)':>10} | {'ratio vs baseline':>17} |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 19}|")
    print(f"| {'baseline: reference loop (per-group, Python)':<44} | {t_ref * 1e3:>10.1f} | {1.0:>17.2f} |")
    print(f"| {'ours: pacs_loss (vectorised)':<44} | {t_ours * 1e3:>10.2f} | {t_ref / t_ours:>16.1f}x |")
    print(f"max abs difference (loss and every gradient entry): {diff:.2e}")

    if not args.data.is_file():
        print(f"\n(b) skipped: {args.data} not found (pass --data path/to/math500.jsonl)")
        return
    n, t_serial, t_pool, t_start, s_ok, p_ok = bench_rewards(args.data, args.workers)
    print(f"\n(b) math-verify reward on {n} MATH-500 gold answers as \\boxed{{}} responses")
    print(f"| {'implementation':<44} | {'items/s':>10} | {'ratio vs baseline':>17} |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 19}|")
    print(f"| {'baseline: serial, one process':<44} | {n / t_serial:>10.1f} | {1.0:>17.2f} |")
    label = f"ours: RewardScorer, {args.workers} workers (warm)"
    print(f"| {label:<44} | {n / t_pool:>10.1f} | {t_serial / t_pool:>16.2f}x |")
    print(f"scored 1.0: serial {s_ok:.0f}/{n}, pool {p_ok:.0f}/{n}; pool start-up (spawn + import) {t_start:.1f}s")


if __name__ == "__main__":
    main()
