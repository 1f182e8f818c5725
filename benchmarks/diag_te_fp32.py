#!/usr/bin/env python
"""Where Transformer Engine's fp32 path loses exactness: each TE module in fp32 against float64 (GPU with TE).

The TE spec in fp32 differs from HF fp32 by 8.8e-3 (max logit, random 1.5B), the sdpa spec by 1.8e-5
(docs/algorithm.md §7.2). Candidates: TF32 in TE's cuBLAS GEMMs, its fused RMSNorm(+Linear), its attention backends
(cuDNN fused / flash / unfused). Each row runs one module on the same random fp32 input and reports the max
relative error against the float64 computation of the same maths, next to torch's own fp32 (TF32 off) as the
baseline. Run it again with ``NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0`` to isolate the attention backend.

Usage: python benchmarks/diag_te_fp32.py [--hidden 1536] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import os


def _rel(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import transformer_engine.pytorch as te

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev, h, t = "cuda", args.hidden, args.tokens
    x = torch.randn(t, h, device=dev)
    rows = []

    lin = te.Linear(h, args.ffn, bias=True, params_dtype=torch.float32).to(dev)
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    rows.append(("te.Linear", _rel(lin(x), ref), _rel(F.linear(x, lin.weight, lin.bias), ref)))

    norm = te.RMSNorm(h, eps=1e-6, params_dtype=torch.float32).to(dev)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    ours = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    rows.append(("te.RMSNorm", _rel(norm(x), ref), _rel(ours, ref)))

    nl = te.LayerNormLinear(h, h, bias=True, normalization="RMSNorm", eps=1e-6, params_dtype=torch.float32).to(dev)
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * nl.layer_norm_weight.double()
    ref = F.linear(normed, nl.weight.double(), nl.bias.double())
    rows.append(("te.LayerNormLinear (RMSNorm)", _rel(nl(x), ref), float("nan")))

    d = h // args.heads
    q, k, v = (torch.randn(t, 1, args.heads, d, device=dev) for _ in range(3))  # [s, b, heads, d]
    attn = te.DotProductAttention(args.heads, d, attn_mask_type="causal", qkv_format="sbhd")
    out = attn(q, k, v)  # [s, b, heads * d]

    def sdpa(dtype):
        qq, kk, vv = (z.to(dtype).permute(1, 2, 0, 3) for z in (q, k, v))  # [b, heads, s, d]
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        return o.permute(2, 0, 1, 3).reshape(t, 1, h)

    ref = sdpa(torch.float64)
    backends = " ".join(f"{n}={os.environ.get(n, '-')}" for n in ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"))
    rows.append((f"te.DotProductAttention ({backends})", _rel(out, ref), _rel(sdpa(torch.float32), ref)))

    print(f"TE fp32 modules vs float64, {t} tokens, hidden {h}, {torch.cuda.get_device_name()}, TE {te.__version__}")
    print("| module | TE fp32 max rel err | torch fp32 (TF32 off) max rel err | ratio |")
    print("|---|---|---|---|")
    for name, ours_err, base in rows:
        print(f"| {name} | {ours_err:.2e} | {base:.2e} | {ours_err / base:.1f}x |")
    print("baseline: torch fp32 with TF32 off; a ratio of ~1e3 is TF32 (10-bit mantissa) in that module")


if __name__ == "__main__":
    main()
