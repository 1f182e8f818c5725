"""Distributed Megatron checks, run by test_distributed.py (one launch runs them all at each of its layouts).

Usage: torchrun --nproc-per-node N tests/mcore/dist_checks.py --workdir W --layout T,P[,V] [--layout ...] (N=1: python)
Reads the tiny HF models in W/models/*; for each layout in turn (TP x PP [x VPP] = N: no data parallelism), in the
same processes (their start-up is most of a launch), writes W/results_tp{T}_pp{P}[_vpp{V}].json (global rank 0)
with one entry per check: parity errors as floats, exactness as booleans.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_pacs.algo.tokens import MicroBatch, make_micro_batches
from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.forward import (
    run_schedule,
    run_schedule_together,
    sequence_logprobs,
)
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.model_checkpoint import load_model_checkpoint, save_model_checkpoint
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
    assert ref_in.grad is not None and shard.grad is not None
    ref_grad = ref_in.grad[:, groups.tp_rank * vp : (groups.tp_rank + 1) * vp]
    results["vocab_logprobs/value"] = (lp - ref_lp).abs().max().item()
    results["vocab_logprobs/entropy"] = (ent - ref_ent).abs().max().item()
    results["vocab_logprobs/grad"] = (shard.grad - ref_grad).abs().max().item()


PACKED_LENS = [(9, 3), (17, 5), (6, 2), (23, 4), (12, 3)]  # (sequence length, prompt length)
PACKED_SPLIT = [[0, 1, 2], [3, 4]]  # two micro-batches of whole sequences
PACKED_ROW = 64  # one packed row length for every micro-batch (pipeline messages need one shape)


def _packing_batches(vocab: int, seed: int = 3):
    """The same five sequences as padded micro-batches (3 rows x longest) and as packed rows of 64 tokens."""
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.data.layout import pack_rows, pad_rows

    gen = torch.Generator().manual_seed(seed)
    batch = RolloutBatch.from_sequences(
        sequences=[torch.randint(3, vocab, (n,), generator=gen).tolist() for n, _ in PACKED_LENS],
        prompt_lens=torch.tensor([p for _, p in PACKED_LENS]),
        response_lens=torch.tensor([n - p for n, p in PACKED_LENS]),
        rewards=torch.zeros(len(PACKED_LENS)),
        group_size=1,
    )
    longest = max(n for n, _ in PACKED_LENS)
    padded = [MicroBatch(*pad_rows(batch, rows, num_rows=3, length=longest)) for rows in PACKED_SPLIT]
    packed = []
    for rows in PACKED_SPLIT:
        tokens, mask, index, seqlens = pack_rows(batch, rows, length=PACKED_ROW)
        packed.append(MicroBatch(tokens, mask, index, seqlens=seqlens))
    return padded, packed


def _packing_pass(models, groups, micro_batches, coeffs):
    """Per-sequence log-likelihoods (float64, on every rank) and the gradient of ``sum_i coeffs_i * l_i``."""
    from megatron_pacs.mcore.forward import model_token_logprobs

    seq = torch.zeros(len(PACKED_LENS), dtype=torch.float64)

    def loss_fn(logits, mb: MicroBatch):
        scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group))
        sums = scored.sequence_sums()
        seq[scored.index] = sums.detach()
        return (sums * coeffs[scored.index]).sum().float(), torch.tensor(1, dtype=torch.int), {}

    for m in models:
        m.zero_grad(set_to_none=True)
        m.train()
    run_schedule(models, micro_batches, loss_fn, forward_only=False)
    if groups.pp_size > 1:
        dist.broadcast(seq, src=groups.last_stage_global_rank, group=groups.pp_group)
    grads = {n: p.grad.detach().clone() for m in models for n, p in m.named_parameters() if p.grad is not None}
    return seq, grads


def check_packing(model_dir, groups, results, spec):
    """Packed vs padded: the same per-sequence log-probs and gradients; a packed neighbour changes nothing else."""
    cfg = AutoConfig.from_pretrained(model_dir)
    models = build_gpt_model(cfg, groups, spec=spec)
    load_hf_weights(models, str(model_dir), groups, cfg)
    padded, packed = _packing_batches(cfg.vocab_size)
    coeffs = torch.linspace(-1.0, 1.5, len(PACKED_LENS), dtype=torch.float64)
    seq_pad, grad_pad = _packing_pass(models, groups, padded, coeffs)
    seq_pack, grad_pack = _packing_pass(models, groups, packed, coeffs)
    results[f"packing_{spec}/seq_logp"] = (seq_pack - seq_pad).abs().max().item()
    assert set(grad_pad) == set(grad_pack)
    grad_diff = max((grad_pack[n] - grad_pad[n]).abs().max().item() for n in grad_pad)
    grad_scale = max(g.abs().max().item() for g in grad_pad.values())
    worst = torch.tensor([grad_diff, grad_scale])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # each pipeline stage holds its own layers' gradients
    results[f"packing_{spec}/grad"], results[f"packing_{spec}/grad_scale"] = worst.tolist()
    # Change sequence 0's tokens (the first neighbour of its packed row): sequences 1 and 2 must not move at all.
    changed = packed[0].tokens.clone()
    changed[0, 1 : PACKED_LENS[0][0]] = (changed[0, 1 : PACKED_LENS[0][0]] + 7) % cfg.vocab_size
    first = MicroBatch(changed, packed[0].score_mask, packed[0].index, seqlens=packed[0].seqlens)
    seq_changed, _ = _packing_pass(models, groups, [first, packed[1]], coeffs)
    results[f"packing_{spec}/neighbour_moved_self"] = (seq_changed[0] - seq_pack[0]).abs().item()
    results[f"packing_{spec}/neighbour_moved_others"] = (seq_changed[1:] - seq_pack[1:]).abs().max().item()


def _collect_token_logprobs(groups, out: dict):
    """A forward-only loss function keeping each scored token's log-prob per (response, rank) in ``out``."""
    from megatron_pacs.mcore.forward import model_token_logprobs

    def loss_fn(logits, mb: MicroBatch):
        scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group))
        owners = scored.index[scored.seq].tolist()
        for key, value in zip(zip(owners, scored.rank.tolist(), strict=True), scored.logp.tolist(), strict=True):
            out[key] = value
        return scored.logp.sum(), torch.tensor(1, dtype=torch.int), {}

    return loss_fn


def check_together(model_dir, groups, results, spec):
    """Two models of one layout (the actor and a reference with other weights) run together in one forward-only
    schedule give, bit for bit, what each gives alone, padded and packed; and the two really differ."""
    cfg = AutoConfig.from_pretrained(model_dir)
    first = build_gpt_model(cfg, groups, spec=spec)
    second = build_gpt_model(cfg, groups, spec=spec)
    load_hf_weights(first, str(model_dir), groups, cfg)
    load_hf_weights(second, str(model_dir), groups, cfg)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for p in (p for m in second for p in m.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    for m in (*first, *second):
        m.eval()
    for layout, micro_batches in zip(("padded", "packed"), _packing_batches(cfg.vocab_size), strict=True):
        alone: list[dict] = [{}, {}]
        with torch.no_grad():
            for models, out in zip((first, second), alone, strict=True):
                run_schedule(models, micro_batches, _collect_token_logprobs(groups, out), forward_only=True)
            together: list[dict] = [{}, {}]
            run_schedule_together(
                [first, second], micro_batches, [_collect_token_logprobs(groups, out) for out in together]
            )
        if groups.is_last_stage:
            assert alone[0].keys() == together[0].keys() == alone[1].keys() == together[1].keys()
            results[f"together_{spec}_{layout}/identical"] = alone == together
            results[f"together_{spec}_{layout}/models_differ"] = max(abs(alone[0][k] - alone[1][k]) for k in alone[0])


def run_layout(workdir: Path, tp: int, pp: int, vpp: int | None) -> None:
    """Every check at one layout; the groups of the layout before it (same world) are replaced."""
    layout = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        overlap_p2p_comm=vpp is not None,  # interleaved: overlapped, not batched (the defaults otherwise)
        batch_p2p_comm=vpp is None,
    )
    groups = init_parallel(layout)
    assert groups.dp_size == 1, f"--layout {tp},{pp} on {dist.get_world_size()} ranks: data parallelism is not checked"
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (3, 24))
    results: dict[str, object] = {}
    for model_dir in sorted((workdir / "models").iterdir()):
        models, cfg = check_model(model_dir.name, model_dir, groups, tokens, results)
        if model_dir.name == "qwen2_tied" and tp == 2 and pp == 1:
            save_model_checkpoint(models, workdir / "ckpt_tp2", {"hf_config": cfg.to_dict()})
    check_model("qwen2_untied", workdir / "models" / "qwen2_untied", groups, tokens, results, spec="sdpa")
    check_vocab_logprobs(groups, results)
    for spec in ("local", "sdpa"):
        check_packing(workdir / "models" / "qwen2_untied", groups, results, spec)
        check_together(workdir / "models" / "qwen2_untied", groups, results, spec)
    ckpt = workdir / "ckpt_tp2"
    if tp == 1 and pp == 1 and ckpt.is_dir():
        cfg = AutoConfig.from_pretrained(workdir / "models" / "qwen2_tied")
        models = build_gpt_model(cfg, groups)
        load_model_checkpoint(models, ckpt)
        ref_logits, _ = hf_reference(workdir / "models" / "qwen2_tied", tokens)
        logits = gathered_logits(models, groups, tokens)
        assert logits is not None  # one stage: the last
        results["ckpt_tp2_to_tp1/logits"] = (logits.double() - ref_logits).abs().max().item()
    merged: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(merged, results)
    if dist.get_rank() == 0:
        combined: dict[str, object] = {}
        for r in merged:
            combined.update(r)
        suffix = f"_vpp{vpp}" if vpp else ""
        (workdir / f"results_tp{tp}_pp{pp}{suffix}.json").write_text(json.dumps(combined, indent=2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument(
        "--layout", action="append", required=True, help="T,P[,V]: TP, PP[, VPP]; repeated: run one after another"
    )
    args = ap.parse_args()
    for spec in args.layout:
        tp, pp, *vpp = (int(x) for x in spec.split(","))
        run_layout(args.workdir, tp, pp, vpp[0] if vpp else None)
    destroy_parallel()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
