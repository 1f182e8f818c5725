#!/usr/bin/env python
"""Compare token log-probs of a HF model under transformers and under Megatron-Core (any TP/PP layout).

Each JSONL row gives a text: ``{"text": ...}``, or a problem row (ours, MATH-500, canonical) which becomes the
PACS chat prompt followed by its answer. Prints, per sequence, the max and mean absolute difference.

Example:
    python tools/compare_logprobs.py --hf-dir /models/Qwen2.5-0.5B --data data/math500.jsonl --num 8 \\
        --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megatron_pacs.utils.launch import ensure_world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_texts(path: str, num: int, tokenizer) -> list[list[int]]:
    from megatron_pacs.data import apply_chat_template
    from megatron_pacs.data.formats import to_prompt_row

    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if len(out) >= num:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                out.append(tokenizer(rec["text"])["input_ids"])
                continue
            row = to_prompt_row(rec, data_source="compare", where=f"{path}:{i + 1}", index=i)
            ids = apply_chat_template(tokenizer, row.prompt)
            out.append(ids + tokenizer(f"The answer is \\boxed{{{row.ground_truth}}}.")["input_ids"])
    if not out:
        raise ValueError(f"{path} holds no rows")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--data", required=True, help="JSONL file")
    p.add_argument("--num", type=int, default=8, help="rows to compare")
    p.add_argument("--max-length", type=int, default=1024, help="truncate sequences to this many tokens")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = p.parse_args(argv)
    code = ensure_world(args.tensor_model_parallel_size * args.pipeline_model_parallel_size, argv)
    if code is not None:
        return code

    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.forward import token_logprobs
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
    from megatron_pacs.mcore.weights import load_hf_weights

    groups = init_parallel(
        ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    seqs = [s[: args.max_length] for s in load_texts(args.data, args.num, tokenizer)]
    length = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(seqs), length), pad, dtype=torch.long)
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
        valid[i, 1 : len(s)] = True
    cfg = AutoConfig.from_pretrained(args.hf_dir)
    models = build_gpt_model(cfg, groups, dtype=DTYPES[args.dtype])
    load_hf_weights(models, args.hf_dir, groups, cfg)
    ours = token_logprobs(models, groups, tokens, micro_batch_size=args.micro_batch_size).cpu()
    del models  # the HF reference goes where the Megatron model was (this rank's GPU on a GPU machine)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        hf = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=DTYPES[args.dtype]).to(device).eval()
        with torch.no_grad():
            logits = hf(input_ids=tokens.to(hf.device)).logits.float()
        ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None].to(logits.device)).squeeze(-1)
        diff = (ours.cpu() - ref.cpu()).abs()
        mask = valid[:, 1:]
        print(f"HF vs Megatron (TP={groups.tp_size}, PP={groups.pp_size}, {args.dtype}) token log-probs")
        print(f"| {'seq':>4} | {'tokens':>6} | {'max abs diff':>12} | {'mean abs diff':>13} |")
        print(f"|{'-' * 6}|{'-' * 8}|{'-' * 14}|{'-' * 15}|")
        for i in range(len(seqs)):
            d = diff[i][mask[i]]
            print(f"| {i:>4} | {d.numel():>6} | {d.max().item():>12.3e} | {d.mean().item():>13.3e} |")
        print(f"overall max abs diff {diff[mask].max().item():.3e}")
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
