"""Launched by tests/test_trainer.py (one process per rank; see ensure_world): the trainer's update on real groups.

modes:
  rollouts   world 1: start the real fleet + scorer through the Trainer, collect one step of rollouts, save them
             (batch.pt), then train them with five micro-batching variants (padded and packed), saving each
             variant's weights.
  tp2        world 2, TP=2: train the saved batch padded and packed and save the weights; then a NaN injected
             into rank 1's gradient must skip the step on both ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_pacs.utils.launch import ensure_world

# Adam divides by sqrt(v) + eps: with a tiny eps, parameters whose gradient is at rounding level (1e-9) get a
# full-size step of either sign; a larger eps keeps the comparison about the gradient, not about rounding.
ADAM_EPS = 1e-6

VARIANTS = {
    # name: (keep_groups_in_microbatch, micro_batch_size, max_tokens_per_microbatch, sequence_packing)
    "budget_split": (False, 8, None, False),  # set in main: a padded token budget that splits groups
    "groups_intact": (True, 4, None, False),
    "rows3": (False, 3, None, False),
    "packed_split": (False, 8, None, True),  # set in main: a packed budget that splits groups
    "packed_groups": (True, 4, None, True),  # whole groups packed, direct loss
}


def _config(args, **batch):
    from megatron_pacs.config import (
        BatchConfig,
        DataConfig,
        LossConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        RewardConfig,
        RunConfig,
        TrainConfig,
    )

    b = dict(global_batch_size=4, group_size=4, ppo_mini_batch_size=2, max_prompt_length=96, max_response_length=12)
    b.update(batch)
    return TrainConfig(
        model=ModelConfig(hf_model=args.model),
        parallel=ParallelConfig(tensor_model_parallel_size=args.tp),
        batch=BatchConfig(**b),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, adam_eps=ADAM_EPS),
        loss=LossConfig(loss=args.loss),
        data=DataConfig(train_data=[args.data]),
        reward=RewardConfig(reward_workers=1),
        run=RunConfig(log_dir=str(Path(args.out) / "run")),
    )


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone() for n, t in actor.export_hf_weights()}


def _train(cfg, groups, batch, poison=False):
    """Train ``batch`` with a fresh actor; ``poison`` makes this rank's gradient NaN (tests/faults.py)."""
    from faults import poison_gradient

    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.update import update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    actor = Actor(cfg.model, groups, cfg.optim)
    if poison:
        poison_gradient(actor.models)
    objective = build_objective(cfg.loss, cfg.batch)
    metrics = update_policy(actor, batch, objective, cfg.batch, groups, PhaseTimer(), temperature=1.0)
    return _weights(actor), metrics


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["rollouts", "tp2"])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loss", default="pacs")
    args = p.parse_args()
    args.tp = 2 if args.mode == "tp2" else 1
    code = ensure_world(args.tp)
    if code is not None:
        return code
    import torch.distributed as dist

    out = Path(args.out)
    results: dict = {}
    writer = True  # the one process that writes results_<mode>.json
    if args.mode == "rollouts":
        from megatron_pacs.data.formats import read_prompt_rows
        from megatron_pacs.trainer import Trainer

        cfg = _config(args)
        rows, _ = read_prompt_rows(args.data)
        with Trainer(cfg) as trainer:
            batch = trainer.source.collect(rows[:4], step=1).batch
            # A random tiny model scores 0 everywhere, where the PACS gradient vanishes; fix a mixed pattern so
            # the update is non-trivial (the rollouts themselves are the fleet's).
            batch.rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
            torch.save(batch, out / "batch.pt")
            longest = int(batch.lengths.max())
            VARIANTS["budget_split"] = (False, 8, 3 * longest, False)  # 3 rows per micro-batch: groups of 4 split
            # 5 sequences' worth of tokens per packed micro-batch: groups of 4 split, micro-batches filled unevenly
            VARIANTS["packed_split"] = (False, 8, 5 * longest, True)
            for name, (keep, mbs, budget, packing) in VARIANTS.items():
                vcfg = _config(
                    args,
                    keep_groups_in_microbatch=keep,
                    micro_batch_size=mbs,
                    max_tokens_per_microbatch=budget,
                    sequence_packing=packing,
                )
                weights, metrics = _train(vcfg, trainer.groups, batch)
                torch.save(weights, out / f"weights_{name}.pt")
                results[name] = metrics
    else:
        from megatron_pacs.config import ParallelConfig
        from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel

        cfg = _config(args, sequence_packing=False)
        groups = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
        batch = torch.load(out / "batch.pt", weights_only=False)
        weights, results["tp2"] = _train(cfg, groups, batch)
        if dist.get_rank() == 0:
            torch.save(weights, out / "weights_tp2.pt")
        weights, results["tp2_packed"] = _train(_config(args), groups, batch)
        if dist.get_rank() == 0:
            torch.save(weights, out / "weights_tp2_packed.pt")
        nan_weights, results["nan"] = _train(cfg, groups, batch, poison=dist.get_rank() == 1)
        writer = dist.get_rank() == 0
        if writer:
            torch.save(nan_weights, out / "weights_nan.pt")
        # destroy_parallel ends the default group too, so the writer is chosen above: deciding it after, both ranks
        # wrote the file at once and the CI run read two documents run together.
        destroy_parallel()
    if writer:
        (out / f"results_{args.mode}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
