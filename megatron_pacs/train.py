"""PACS (or GRPO) RLVR training: Megatron-Core actor, Ray-managed vLLM fleet, math-verify rewards.

Every rank runs this same SPMD program; rank 0 also drives the fleet and the reward pool::

    torchrun --nnodes 8 --nproc-per-node 8 ... -m megatron_pacs.train --hf-model Qwen2.5-7B --train-data ...
    python -m megatron_pacs.train --hf-model DIR --train-data FILE ...     # one process (CPU or one GPU)
    python -m megatron_pacs.train ... --dry-run --world-size 64            # check a layout on any machine

One step: prompts -> fleet.generate (n per prompt) -> rewards -> broadcast -> old log-probs where needed ->
per mini-batch a PACS two-phase update through Megatron's forward_backward_func -> weights into the fleet.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatron_pacs.config import TrainConfig, parse_config
from megatron_pacs.utils.logging import get_logger

log = get_logger("train")


def dry_run(cfg: TrainConfig) -> int:
    """Validate the configuration for ``--world-size`` ranks and print the layout and memory plan."""
    from megatron_pacs.estimate import ModelShape, plan_run

    world = cfg.run.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world, need_files=False)
    config_json = Path(cfg.model.hf_model, "config.json")
    if not config_json.is_file():
        raise ValueError(f"--hf-model: {cfg.model.hf_model!r} has no config.json (the dry run needs the shapes)")
    p, b = cfg.parallel, cfg.batch
    plan = plan_run(
        ModelShape.from_hf_config(json.loads(config_json.read_text())), world_size=world,
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_model_parallel_size, sequence_parallel=p.sequence_parallel,
        global_batch_size=b.global_batch_size, group_size=b.group_size, ppo_mini_batch_size=b.ppo_mini_batch_size,
        ppo_epochs=b.ppo_epochs, micro_batch_size=b.micro_batch_size,
        max_tokens_per_microbatch=b.max_tokens_per_microbatch, max_prompt_length=b.max_prompt_length,
        max_response_length=b.max_response_length, bf16=cfg.model.bf16, fp8=cfg.model.fp8_format,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
        recompute_activations=cfg.model.recompute_activations, num_engines=cfg.rollout.num_engines,
        rollout_tp=cfg.rollout.rollout_tensor_parallel_size,
    )  # fmt: skip
    print(plan.format())
    return 0


def load_prompts(cfg: TrainConfig) -> tuple[list, dict[str, list]]:
    """Training rows and validation rows per source, prompts over --max-prompt-length dropped (and counted)."""
    from transformers import AutoTokenizer

    from megatron_pacs.data.formats import read_prompt_rows
    from megatron_pacs.data.prepare import filter_by_prompt_length

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_model)
    limit = cfg.batch.max_prompt_length

    def read(path: str) -> list:
        rows, _ = read_prompt_rows(path)
        kept, dropped = filter_by_prompt_length(rows, tokenizer, limit)
        if dropped:
            log.warning("%s: dropped %d prompts longer than --max-prompt-length %d", path, dropped, limit)
        return kept

    train = [row for path in cfg.run.train_data for row in read(path)]
    val = {Path(path).stem: read(path) for path in cfg.run.val_data}
    return train, val


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    if cfg.run.dry_run:
        return dry_run(cfg)
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))  # before any model, engine or process group exists
    train_rows, val_rows = load_prompts(cfg)
    from megatron_pacs.data.loader import PromptLoader

    loader = PromptLoader(train_rows, cfg.batch.global_batch_size, seed=cfg.run.seed)

    from megatron_pacs.trainer import Trainer

    with Trainer(cfg, val_rows) as trainer:
        trainer.fit(loader)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:  # bad flags or data: the message names the flag and the fix
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
