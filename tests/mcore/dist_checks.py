"""Distributed Megatron checks, run under torchrun by test_distributed.py (one launch per layout runs them all).

Usage: torchrun --nproc-per-node N tests/mcore/dist_checks.py --workdir W --tp T --pp P [--vpp V]
Reads the tiny HF models in W/models/*, writes W/results_tp{T}_pp{P}.json (global rank 0) with one entry per
check: parity errors as floats, exactness as booleans.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.checkpoint import load_model_checkpoint, save_model_checkpoint
from megatron_pacs.mcore.forward import MicroBatch, make_micro_batches, run_schedule, sequence_logprobs
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights


def hf_reference(model_dir, tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits.double()
    return logits, {k: v for k, v in hf.state_dict().items()}


def gathered_logits(models, groups, tokens):
    def loss_fn(logits, mb: MicroBatch):
        parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
        full = torch.cat(parts, -1)
        return full.sum() * 0, torch.tensor(1, dtype=torch.int), {"logits": full.detach()}

    mbs = make_micro_batches(tokens, torch.ones_like(tokens, dtype=torch.bool), 2)
    with torch.no_grad():
        reports = run_schedule(models, mbs, loss_fn, forward_only=True)
    if not groups.is_last_stage:
        return None
    return torch.cat([r["logits"] for r in reports])[: tokens.shape[0]]


def check_model(name, model_dir, groups, tokens, results, spec="local"):
    cfg = AutoConfig.from_pretrained(model_dir)
    models = build_gpt_model(cfg, groups, spec=spec)
    load_hf_weights(models, str(model_dir), groups, cfg)
    ref_logits, ref_sd = hf_reference(model_dir, tokens)
    logits = gathered_logits(models, groups, tokens)
    if logits is not None:
        results[f"logits{'' if spec == 'local' else '_' + spec}/{name}"] = (
            (logits.double() - ref_logits).abs().max().item()
        )
    if spec != "local":
        return models, cfg
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, tokens.shape[1] // 2 :] = True
    seq = sequence_logprobs(models, groups, tokens, mask, micro_batch_size=2)
    ref_tok = torch.log_softmax(ref_logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ref_seq = (ref_tok * mask[:, 1:]).sum(-1)
    results[f"seq_logp/{name}"] = (seq.double() - ref_seq).abs().max().item()
    exported = dict(export_hf_weights(models, groups, cfg))
    if getattr(cfg, "tie_word_embeddings", False):
        ref_sd.pop("lm_head.weight", None)
    results[f"export_bitwise/{name}"] = set(exported) == set(ref_sd) and all(
        torch.equal(exported[k], ref_sd[k]) for k in ref_sd
    )
    return models, cfg


def check_vocab_logprobs(groups, results):
    torch.manual_seed(7)  # the same full logits on every rank; each rank takes its vocabulary slice
    num_tokens, vocab = 33, 48
    full = torch.randn(num_tokens, vocab, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab, (num_tokens,))
    w_lp, w_h = torch.randn(num_tokens, dtype=torch.float64), torch.randn(num_tokens, dtype=torch.float64)
    vp = vocab // groups.tp_size
    shard = full[:, groups.tp_rank * vp : (groups.tp_rank + 1) * vp].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        shard, labels, groups.tp_group, chunk_size=7, temperature=0.8, return_entropy=True
    )
    (lp * w_lp + ent * w_h).sum().backward()
    ref_in = full.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_in / 0.8, -1)
    ref_lp = ref.gather(1, labels[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    (ref_lp * w_lp + ref_ent * w_h).sum().backward()
    ref_grad = ref_in.grad[:, groups.tp_rank * vp : (groups.tp_rank + 1) * vp]
    results["vocab_logprobs/value"] = (lp - ref_lp).abs().max().item()
    results["vocab_logprobs/entropy"] = (ent - ref_ent).abs().max().item()
    results["vocab_logprobs/grad"] = (shard.grad - ref_grad).abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    args = ap.parse_args()
    interleaved = {"overlap_p2p_comm": True, "batch_p2p_comm": False} if args.vpp else {}
    layout = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        **interleaved,
    )
    groups = init_parallel(layout)
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (3, 24))
    results: dict[str, object] = {}
    for model_dir in sorted((args.workdir / "models").iterdir()):
        models, cfg = check_model(model_dir.name, model_dir, groups, tokens, results)
        if model_dir.name == "qwen2_tied" and args.tp == 2 and args.pp == 1:
            save_model_checkpoint(models, args.workdir / "ckpt_tp2", {"hf_config": cfg.to_dict()})
    check_model("qwen2_untied", args.workdir / "models" / "qwen2_untied", groups, tokens, results, spec="sdpa")
    check_vocab_logprobs(groups, results)
    ckpt = args.workdir / "ckpt_tp2"
    if args.tp == 1 and args.pp == 1 and ckpt.is_dir():
        cfg = AutoConfig.from_pretrained(args.workdir / "models" / "qwen2_tied")
        models = build_gpt_model(cfg, groups)
        load_model_checkpoint(models, ckpt)
        ref_logits, _ = hf_reference(args.workdir / "models" / "qwen2_tied", tokens)
        results["ckpt_tp2_to_tp1/logits"] = (
            (gathered_logits(models, groups, tokens).double() - ref_logits).abs().max().item()
        )
    merged: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(merged, results)
    if dist.get_rank() == 0:
        combined: dict[str, object] = {}
        for r in merged:
            combined.update(r)
        suffix = f"_vpp{args.vpp}" if args.vpp else ""
        (args.workdir / f"results_tp{args.tp}_pp{args.pp}{suffix}.json").write_text(json.dumps(combined, indent=2))
    destroy_parallel()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
