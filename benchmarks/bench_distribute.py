#!/usr/bin/env python
"""Rollouts from the driver to the trainer ranks: tensors, each data-parallel rank its share, vs pickled objects.

Baseline (measured in the same run): ``broadcast_object_list`` of the step's rollouts as the trainer sent them
before (token lists, lengths, rewards, and the response texts for the dumps) from rank 0 to every rank. Ours:
``megatron_pacs.distribute.distribute_rollouts`` (metadata broadcast, then each data-parallel rank's share of the
tokens and engine log-probs as int32 / float32 tensors). gloo on CPU, 4 local ranks (DP=4), 1,024 prompts x 8
responses x ~2,000 tokens (prompts ~200, responses log-normal around 1,800). Time is the slowest rank's, median of
3 after a warm-up.

Usage: python benchmarks/bench_distribute.py [--prompts 1024] [--group-size 8] [--world 4]
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_pacs.utils.launch import ensure_world


def build(prompts: int, group: int, seed: int = 0):
    """The driver's batch and the old payload: token lists, tensors and the response texts."""
    from megatron_pacs.data.batching import RolloutBatch

    rng = random.Random(seed)
    seqs, plens, rlens, texts = [], [], [], []
    for _ in range(prompts):
        p = min(max(int(rng.gauss(200, 40)), 64), 512)
        prompt = [rng.randrange(3, 150_000) for _ in range(p)]
        for _ in range(group):
            r = min(max(int(rng.lognormvariate(math.log(1800), 0.3)), 16), 4096)
            seqs.append(prompt + [rng.randrange(3, 150_000) for _ in range(r)])
            plens.append(p)
            rlens.append(r)
            texts.append("x" * (4 * r))  # ~4 characters per token
    engine = torch.randn(sum(rlens))
    rewards = torch.zeros(len(seqs))
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor(plens), torch.tensor(rlens), rewards, group, engine_logprobs=engine
    )
    old_payload = {
        "sequences": seqs,
        "prompt_lens": torch.tensor(plens),
        "response_lens": torch.tensor(rlens),
        "rewards": rewards,
        "records": [{"output": t} for t in texts],
    }
    return batch, old_payload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    code = ensure_world(args.world)
    if code is not None:
        return code
    from megatron_pacs.config import BatchConfig, ParallelConfig
    from megatron_pacs.distribute import distribute_rollouts
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    groups = init_parallel(ParallelConfig())
    rank = dist.get_rank()
    batch, old = build(args.prompts, args.group_size) if rank == 0 else (None, None)
    cfg = BatchConfig(global_batch_size=args.prompts, group_size=args.group_size, ppo_mini_batch_size=args.prompts // 4)

    def timed(fn) -> float:
        times = []
        for i in range(4):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i:  # the first is a warm-up
                times.append(float(elapsed))
        return statistics.median(times)

    def baseline() -> None:
        box = [old]
        dist.broadcast_object_list(box, src=0)

    received: list = []

    def ours() -> None:
        received[:] = [distribute_rollouts(batch, cfg, groups)]

    t_old, t_new = timed(baseline), timed(ours)
    # what reached a receiving rank, as sent: its share's tokens (int32) and engine log-probs (float32), and the
    # step's metadata (two [S] long lengths, [S] float32 rewards, a 3-long header)
    mine = received[0]
    engine = mine.engine_logprobs.numel() if mine.engine_logprobs is not None else 0
    num = mine.num_responses
    size = (4 * mine.token_ids.numel() + 4 * engine + 8 * 2 * num + 4 * num + 8 * 3) if rank else 0
    largest = torch.tensor([float(size)])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if rank == 0:
        assert batch is not None
        pickled = len(pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL)) / 2**20
        share = float(largest) / 2**20
        tokens = int(batch.lengths.sum())
        print(json.dumps({"baseline_s": t_old, "ours_s": t_new, "pickled_mb": pickled, "share_mb": share}))
        print(
            f"rollouts to {args.world} gloo ranks (DP={args.world}): {args.prompts} x {args.group_size} responses, "
            f"{tokens / 1e6:.1f}M tokens, slowest rank, median of 3"
        )
        print("| transport | MB each receiving rank gets (largest) | seconds | speed-up |")
        print("|---|---|---|---|")
        print(f"| baseline: broadcast_object_list of the pickled step | {pickled:.0f} | {t_old:.2f} | 1.00x |")
        print(f"| ours: tensor shares (distribute_rollouts) | {share:.0f} | {t_new:.2f} | {t_old / t_new:.1f}x |")
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
