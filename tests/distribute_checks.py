"""Launched by tests/test_distribute.py (one process per rank, see ensure_world): rank 0's rollouts reach every
rank as its data-parallel share, exactly.

Usage: python tests/distribute_checks.py --out DIR --world 4 [--layouts TPxPP,...]

Every layout runs in the same ranks, one after another (Megatron's groups rebuilt for each): the ranks' start-up
(torch and Megatron imports) is most of a launch's time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_pacs.utils.launch import ensure_world


def synthetic_batch(num_prompts: int = 8, group_size: int = 4, seed: int = 0):
    """A deterministic batch every rank can rebuild to check what it received."""
    from megatron_pacs.data.batching import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(3, 9, (num_prompts,), generator=gen).repeat_interleave(group_size)
    response_lens = torch.randint(1, 40, (num_prompts * group_size,), generator=gen)
    seqs = [
        torch.randint(3, 5000, (int(p + r),), generator=gen).tolist()
        for p, r in zip(prompt_lens, response_lens, strict=True)
    ]
    engine = torch.randn(int(response_lens.sum()), generator=gen)
    rewards = (torch.rand(len(seqs), generator=gen) > 0.5).float()
    # the engine's routing (router replay): [L_i - 1 tokens, 3 layers, top-2] of 300 experts (past one byte)
    routed = [torch.randint(0, 300, (len(s) - 1, 3, 2), generator=gen) for s in seqs]
    return RolloutBatch.from_sequences(
        seqs, prompt_lens, response_lens, rewards, group_size, engine_logprobs=engine, routed_experts=routed
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layouts", default="1x1", help="comma-separated TPxPP layouts, checked in turn")
    args = ap.parse_args()
    code = ensure_world(args.world)
    if code is not None:
        return code
    from megatron_pacs.mcore.parallel import destroy_parallel

    for layout in args.layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        check_layout(args.out, tp, pp)
    destroy_parallel()
    return 0


def check_layout(out: Path, tp: int, pp: int) -> None:
    """Distribute the synthetic batch at TP=tp x PP=pp (DP the rest); rank 0 writes the failures found on every
    rank to ``out/transport_tp{tp}_pp{pp}.json``."""
    import torch.distributed as dist

    from megatron_pacs.config import BatchConfig, ParallelConfig
    from megatron_pacs.data.layout import rank_rows
    from megatron_pacs.distribute import distribute_rollouts
    from megatron_pacs.mcore.parallel import init_parallel

    groups = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    full = synthetic_batch()
    failures: list[str] = []
    for packing in (False, True):
        cfg = BatchConfig(global_batch_size=8, group_size=4, ppo_mini_batch_size=4, sequence_packing=packing)
        share = distribute_rollouts(full if dist.get_rank() == 0 else None, cfg, groups)
        rows = rank_rows(full.lengths.tolist(), cfg, 4, groups.dp_size)[groups.dp_rank]
        tag = f"packing={packing} rank={dist.get_rank()}"
        if share.held.nonzero().flatten().tolist() != rows:
            failures.append(f"{tag}: holds {share.held.nonzero().flatten().tolist()}, expected {rows}")
        for name in ("prompt_lens", "response_lens", "rewards"):
            if not torch.equal(getattr(share, name), getattr(full, name)):
                failures.append(f"{tag}: {name} differs")
        eo, feo = share.engine_offsets, full.engine_offsets
        for i in rows:
            if not torch.equal(share.sequence(i).long(), full.sequence(i).long()):
                failures.append(f"{tag}: sequence {i} differs")
            assert share.engine_logprobs is not None and full.engine_logprobs is not None
            mine = share.engine_logprobs[int(eo[i]) : int(eo[i + 1])]
            theirs = full.engine_logprobs[int(feo[i]) : int(feo[i + 1])]
            if not torch.equal(mine, theirs):
                failures.append(f"{tag}: engine log-probs of {i} differ")
            assert share.routed_experts is not None and full.routed_experts is not None
            mine = share.routed_experts[int(share.offsets[i]) : int(share.offsets[i + 1])]
            theirs = full.routed_experts[int(full.offsets[i]) : int(full.offsets[i + 1])]
            if not torch.equal(mine, theirs):
                failures.append(f"{tag}: routed experts of {i} differ")
        held_tokens = int(share.token_ids.numel())
        if held_tokens != sum(int(full.lengths[i]) for i in rows):
            failures.append(f"{tag}: holds {held_tokens} tokens, more than its share")
    # the driver's stop in place of a step's rollouts (a rollout cluster that did not come back): every other rank
    # raises RolloutClusterLost out of its wait, with the line that points at rank 0's
    from megatron_pacs.distribute import send_stop
    from megatron_pacs.rollout.lost import FOLLOWER_LINE, RolloutClusterLost

    if dist.get_rank() == 0:
        send_stop()
    else:
        try:
            distribute_rollouts(None, cfg, groups)
            failures.append(f"rank {dist.get_rank()}: the stop did not raise")
        except RolloutClusterLost as exc:
            if str(exc) != FOLLOWER_LINE:
                failures.append(f"rank {dist.get_rank()}: stop said {exc}")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    if dist.get_rank() == 0:
        (out / f"transport_tp{tp}_pp{pp}.json").write_text(json.dumps([f for part in gathered for f in part]))


if __name__ == "__main__":
    sys.exit(main())
