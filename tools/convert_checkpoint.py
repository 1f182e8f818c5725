#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and Megatron-Core (distributed checkpoint, any TP/PP/EP layout).

Examples:
    # HF -> Megatron at TP=2, PP=1 (launches 2 local ranks itself, or run it under torchrun)
    python tools/convert_checkpoint.py hf-to-mcore --hf-dir /models/Qwen2.5-7B --out ckpt/qwen7b-tp2 \\
        --tensor-model-parallel-size 2
    # Megatron (any layout) -> HF directory loadable by transformers and vLLM
    python tools/convert_checkpoint.py mcore-to-hf --load ckpt/qwen7b-tp2 --hf-config /models/Qwen2.5-7B \\
        --out hf/qwen7b
    # a training run's --save directory: the checkpoint the tracker names (as the trainer's --load), or --ckpt-step
    python tools/convert_checkpoint.py mcore-to-hf --load ckpt/run1 --ckpt-step 300 --hf-config /models/Qwen2.5-7B \\
        --out hf/run1-step300
    # a PPO run's critic as a one-label token-classification model (AutoModelForTokenClassification)
    python tools/convert_checkpoint.py mcore-to-hf --load ckpt/ppo-run --critic --hf-config /models/Qwen2.5-7B \
        --out hf/ppo-critic
    # Qwen3-MoE: experts split over expert parallelism (EP=2: half the experts per rank); any layout loads back
    python tools/convert_checkpoint.py hf-to-mcore --hf-dir /models/Qwen3-30B-A3B --out ckpt/a3b-ep8 \\
        --expert-model-parallel-size 8 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from megatron_pacs.utils.launch import ensure_world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    a.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to write")
    a.add_argument("--tensor-model-parallel-size", type=int, default=1)
    a.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    a.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP of the MoE experts' shards")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype of the checkpoint")
    b = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint (any layout) -> HF directory")
    b.add_argument(
        "--load",
        required=True,
        help="a checkpoint folder (hf-to-mcore's --out, a trainer's iter_* folder) or a trainer's --save directory "
        "(the checkpoint its tracker names, as the trainer's --load resumes)",
    )
    b.add_argument("--ckpt-step", type=int, default=None, help="with a --save directory: convert iter_<this step>")
    b.add_argument("--hf-config", required=True, help="HF directory with the config and tokenizer files")
    b.add_argument("--out", required=True, help="HF directory to write")
    b.add_argument("--tensor-model-parallel-size", type=int, default=1, help="ranks to load with (resharded)")
    b.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    b.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP to load MoE experts with")
    b.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="output dtype (default: as stored)")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0)
    b.add_argument(
        "--critic",
        action="store_true",
        help="export a --loss ppo checkpoint's critic (its critic/ folder) as a one-label HF token-classification "
        "model (AutoModelForTokenClassification; the value head is its score layer) instead of the policy",
    )
    for sp in (a, b):
        sp.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    return p.parse_args(argv)


def _check_output(out: str, force: bool) -> None:
    path = Path(out)
    if path.exists() and any(path.iterdir()) and not force:
        raise ValueError(f"output {out} exists and is not empty; pass --force to overwrite it")


def resolve_load(load: str, ckpt_step: int | None) -> Path:
    """The checkpoint folder ``--load`` (and ``--ckpt-step``) name, as the trainer's ``--load`` reads them.

    Raises:
        ValueError: naming the file or flag, when there is no such complete checkpoint.
    """
    from megatron_pacs.utils.checkpoint_dirs import META_FILE, checkpoint_dir, choose_checkpoint, read_metadata

    root = Path(load)
    if ckpt_step is not None:
        if (root / META_FILE).exists():
            raise ValueError(f"--ckpt-step: --load {load} is a checkpoint folder already; drop one of the two")
        ckpt = checkpoint_dir(root, ckpt_step)
        if not ckpt.is_dir():
            steps = sorted(p.name for p in root.glob("iter_*"))
            raise ValueError(f"--ckpt-step: {ckpt} does not exist (there: {', '.join(steps) or 'no checkpoints'})")
        read_metadata(ckpt)
        return ckpt
    choice = choose_checkpoint(root)
    for note in choice.notes:
        print(f"convert_checkpoint: warning: {note}", file=sys.stderr)
    if choice.checkpoint is None:
        damaged = f": {'; '.join(choice.damaged)}" if choice.damaged else ""
        raise ValueError(f"--load: {load} holds no complete checkpoint{damaged}")
    return choice.checkpoint


def _stored_dtype(meta: dict) -> torch.dtype:
    """The weights' dtype: hf-to-mcore records it; a training checkpoint records its run's --bf16."""
    if "dtype" in meta:
        return DTYPES.get(meta["dtype"], torch.float32)
    bf16 = meta.get("config", {}).get("model", {}).get("bf16", False)
    return torch.bfloat16 if bf16 else torch.float32


def _world_size(args: argparse.Namespace) -> int:
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.expert_model_parallel_size


def _setup(args):
    from transformers import AutoConfig

    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.parallel import init_parallel

    cfg_dir = args.hf_dir if args.command == "hf-to-mcore" else args.hf_config
    hf_config = AutoConfig.from_pretrained(cfg_dir)
    moe = getattr(hf_config, "model_type", None) == "qwen3_moe"
    groups = init_parallel(
        ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            # Megatron's MoE layers refuse TP > 1 without it; it changes no weight's layout.
            sequence_parallel=moe and args.tensor_model_parallel_size > 1,
        )
    )
    return groups, hf_config


def hf_to_mcore(args) -> None:
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.model_checkpoint import save_model_checkpoint
    from megatron_pacs.mcore.weights import load_hf_weights

    groups, hf_config = _setup(args)
    models = build_gpt_model(hf_config, groups, dtype=DTYPES[args.dtype], spec="local")
    load_hf_weights(models, args.hf_dir, groups, hf_config)
    meta = {
        "format": "megatron_pacs.model.v1",
        "source": str(Path(args.hf_dir).resolve()),
        "dtype": args.dtype,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "hf_config": hf_config.to_dict(),
    }
    save_model_checkpoint(models, args.out, meta)
    if groups.tp_rank == groups.pp_rank == groups.dp_rank == 0:
        print(f"wrote Megatron checkpoint {args.out} (TP={groups.tp_size}, PP={groups.pp_size}, EP={groups.ep_size})")


def mcore_to_hf(args) -> None:
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.model_checkpoint import load_model_checkpoint, read_checkpoint_metadata, save_hf_checkpoint
    from megatron_pacs.mcore.weights import export_hf_weights
    from megatron_pacs.utils.hf_checkpoint import hf_state_dict_shapes

    ckpt = resolve_load(args.load, args.ckpt_step)
    meta = read_checkpoint_metadata(ckpt)
    groups, hf_config = _setup(args)
    if args.critic:
        critic_to_hf(args, ckpt, groups, hf_config, _stored_dtype(meta))
        return
    models = build_gpt_model(hf_config, groups, dtype=_stored_dtype(meta), spec="local")
    load_model_checkpoint(models, ckpt)
    save_hf_checkpoint(
        export_hf_weights(models, groups, hf_config),
        args.out,
        side_files_from=args.hf_config,
        max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
        dtype=DTYPES[args.dtype] if args.dtype else None,
        total=len(hf_state_dict_shapes(hf_config)),
    )
    if torch.distributed.get_rank() == 0:
        print(f"wrote HF checkpoint {args.out} (from {ckpt})")


def critic_to_hf(args, ckpt: Path, groups, hf_config, dtype: torch.dtype) -> None:
    """``mcore-to-hf --critic``: the checkpoint's ``critic/`` folder as a one-label token-classification model."""
    from megatron_pacs.mcore.critic import (
        attach_value_heads,
        export_critic_hf_weights,
        token_classification_config,
        untied,
    )
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.model_checkpoint import load_model_weights, save_hf_checkpoint

    if not (ckpt / "critic").is_dir():
        raise ValueError(f"--critic: {ckpt} holds no critic/ folder (not a --loss ppo run's checkpoint)")
    config = untied(hf_config)
    models = attach_value_heads(build_gpt_model(config, groups, dtype=dtype, spec="local"), groups)
    load_model_weights(models, ckpt / "critic")
    save_hf_checkpoint(
        export_critic_hf_weights(models, groups, config),
        args.out,
        side_files_from=args.hf_config,
        hf_config=token_classification_config(hf_config),
        max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
        dtype=DTYPES[args.dtype] if args.dtype else None,
    )
    if torch.distributed.get_rank() == 0:
        print(f"wrote HF token-classification critic {args.out} (from {ckpt / 'critic'})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _check_output(args.out, args.force)
        if args.command == "mcore-to-hf":
            args.load, args.ckpt_step = str(resolve_load(args.load, args.ckpt_step)), None
        elif "RANK" not in os.environ:  # the launcher: a bad folder is refused before any rank starts
            from transformers import AutoConfig

            from megatron_pacs.utils.hf_checkpoint import check_hf_checkpoint

            try:
                hf_config = AutoConfig.from_pretrained(args.hf_dir)
            except OSError as e:
                raise ValueError(f"--hf-dir: {e}") from None
            check_hf_checkpoint(args.hf_dir, hf_config)
    except ValueError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    code = ensure_world(_world_size(args), argv)
    if code is not None:
        return code
    from megatron_pacs.mcore.parallel import destroy_parallel

    try:
        (hf_to_mcore if args.command == "hf-to-mcore" else mcore_to_hf)(args)
    except ValueError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
