"""PACS (or GRPO) RLVR training: Megatron-Core actor, Ray-managed vLLM fleet, math-verify rewards.

Every rank runs this same SPMD program; rank 0 also drives the fleet and the reward pool::

    torchrun --nnodes 8 --nproc-per-node 8 ... -m megatron_pacs.train --hf-model Qwen2.5-7B --train-data ...
    python -m megatron_pacs.train --hf-model DIR --train-data FILE ...     # one process (CPU or one GPU)
    python -m megatron_pacs.train ... --dry-run --world-size 64            # check a layout on any machine

One step: prompts -> fleet.generate (n per prompt) -> rewards -> broadcast -> old log-probs where needed ->
per mini-batch a PACS two-phase update through Megatron's forward_backward_func -> weights into the fleet.
"""

from __future__ import annotations

import os
import sys

from megatron_pacs.config import parse_config


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    if cfg.run.dry_run:
        from megatron_pacs.planner import dry_run  # pure arithmetic, no torch: instant

        return dry_run(cfg)
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))  # before any model, engine or process group exists
    from transformers import AutoTokenizer

    from megatron_pacs.data.loader import PromptLoader
    from megatron_pacs.data.prepare import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_model)
    train_rows, val_rows = load_prompts(cfg.data, tokenizer, cfg.batch.max_prompt_length)

    loader = PromptLoader(train_rows, cfg.batch.global_batch_size, seed=cfg.run.seed)

    from megatron_pacs.trainer import Trainer

    with Trainer(cfg, val_rows) as trainer:
        try:
            trainer.fit(loader)
        except Exception as exc:
            from megatron_pacs.mcore.parallel import lost_rank

            rank = lost_rank(trainer.groups, exc)
            if rank is None:
                raise
            host = trainer.groups.rank_addresses[rank]
            raise RuntimeError(f"lost training rank {rank} (host {host}): a collective with it failed: {exc}") from exc
    if trainer.exit_signal is not None and trainer.exit_signal.received_at is not None:
        from megatron_pacs.utils.exit_signal import report_clean_stop

        report_clean_stop()  # megatron_pacs.torchrun exits 0 once every local rank has
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:  # bad flags or data: the message names the flag and the fix
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
