"""The fused (Triton) token log-prob against a float64 reference and against the chunked torch path.

Run by tests/mcore/test_fused_logprobs.py: under ``TRITON_INTERPRET=1`` on CPU (``torchrun --nproc-per-node=2``:
TP=1 on rank 0 and TP=2 over both ranks, gloo), and in-process on a GPU. Writes ``{name: max abs error}``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs

# (tokens, vocabulary, temperature): one tile, several tiles with a ragged last one, a sampling temperature.
CASES = [(17, 40, 1.0), (33, 5002, 1.0), (29, 9000, 0.7)]


def check(device: torch.device, group: dist.ProcessGroup | None, tag: str) -> dict[str, float]:
    """Max abs errors of fused vs float64 and fused vs chunked, for fp32 and bf16 logits (with the entropy)."""
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    out: dict[str, float] = {}
    for num_tokens, vocab, temp in CASES:
        gen = torch.Generator().manual_seed(vocab)  # the same full logits on every rank
        full = torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64) * 4
        labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
        w_lp, w_h = torch.randn(num_tokens, generator=gen), torch.randn(num_tokens, generator=gen)
        vp = vocab // tp
        for dtype in (torch.float32, torch.bfloat16):
            x = full.to(dtype)  # the reference sees exactly the rounded inputs
            ref_in = x.double().requires_grad_(True)
            ref = torch.log_softmax(ref_in / temp, -1)
            ref_lp = ref.gather(1, labels[:, None]).squeeze(1)
            ref_ent = -(ref.exp() * ref).sum(-1)
            (ref_ent_grad,) = torch.autograd.grad((ref_ent * w_h).sum(), ref_in, retain_graph=True)
            ref_ent_grad = ref_ent_grad[:, rank * vp : (rank + 1) * vp]
            (ref_lp * w_lp + ref_ent * w_h).sum().backward()
            assert ref_in.grad is not None
            ref_grad = ref_in.grad[:, rank * vp : (rank + 1) * vp]
            got = {}
            for impl in ("fused", "chunked"):
                shard = x[:, rank * vp : (rank + 1) * vp].to(device).requires_grad_(True)
                lp, ent = vocab_parallel_logprobs(
                    shard, labels.to(device), group, temperature=temp, return_entropy=True, impl=impl
                )
                (lp * w_lp.to(device) + ent * w_h.to(device)).sum().backward()
                assert shard.grad is not None and shard.grad.dtype == dtype
                got[impl] = (lp.double().cpu(), ent.double().cpu(), shard.grad.double().cpu())
            lp, ent, grad = got["fused"]
            name = f"{tag}/V{vocab}/T{temp}/{str(dtype).split('.')[-1]}"
            out[f"{name}/logp"] = (lp - ref_lp).abs().max().item()
            out[f"{name}/entropy"] = (ent - ref_ent).abs().max().item()
            # The gradient is stored in the logits' dtype: its error relative to the largest gradient entry.
            out[f"{name}/grad_rel"] = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
            out[f"{name}/vs_chunked_logp"] = (lp - got["chunked"][0]).abs().max().item()
            out[f"{name}/vs_chunked_entropy"] = (ent - got["chunked"][1]).abs().max().item()
            # An entropy bonus alone (the log-probs detached) and an entropy only reported (detached): the latter's
            # backward is the log-prob-only one exactly.
            shard = x[:, rank * vp : (rank + 1) * vp].to(device).requires_grad_(True)
            lp, ent = vocab_parallel_logprobs(
                shard, labels.to(device), group, temperature=temp, return_entropy=True, impl="fused"
            )
            (g_ent,) = torch.autograd.grad((ent * w_h.to(device)).sum(), shard, retain_graph=True)
            (g_detached,) = torch.autograd.grad((lp * w_lp.to(device)).sum() + ent.detach().sum(), shard)
            shard2 = x[:, rank * vp : (rank + 1) * vp].to(device).requires_grad_(True)
            lp2 = vocab_parallel_logprobs(shard2, labels.to(device), group, temperature=temp, impl="fused")
            (g_plain,) = torch.autograd.grad((lp2 * w_lp.to(device)).sum(), shard2)
            g_ent = g_ent.double().cpu()
            out[f"{name}/entropy_only/grad_rel"] = (
                (g_ent - ref_ent_grad).abs().max() / ref_ent_grad.abs().max()
            ).item()
            out[f"{name}/detached_equal"] = (g_detached.double() - g_plain.double()).abs().max().item()
    # Leading dims, a strided (sliced) input and an empty input take the same path.
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0)).to(device)
    labels = torch.randint(0, 64 * tp, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    a = vocab_parallel_logprobs(x[:, :-1], labels, group, impl="fused")
    b = vocab_parallel_logprobs(x[:, :-1], labels, group, impl="chunked")
    out[f"{tag}/strided_3d"] = (a - b).abs().max().item() if a.shape == (2, 8) else float("inf")
    empty = vocab_parallel_logprobs(x[:, :0], labels[:, :0], group, impl="fused")
    out[f"{tag}/empty_ok"] = float(empty.shape == (2, 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tp2 = check(torch.device("cpu"), dist.group.WORLD, "tp2")
    # each rank checked its own vocabulary shard's gradient: the worst over both (empty_ok: 1 = fine, so the least)
    shards: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(shards, tp2)
    if dist.get_rank() == 0:
        results = {k: (min if k.endswith("empty_ok") else max)(shard[k] for shard in shards) for k in tp2}
        results["tp2/shards_checked"] = float(len(shards))
        results.update(check(torch.device("cpu"), None, "tp1"))
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
