#!/usr/bin/env python
"""How the PACS importance ratio's level turns an engine/trainer log-prob gap into response weights, with no lag.

A synthetic bf16-like per-token gap (trainer - engine; per token 98% N(0, 5e-4) and 2% N(0, 0.08), optionally a
constant bias) over responses of 4,096 tokens: the sequence ratio exp(sum gap) against the per-token geometric mean
exp(mean gap), both truncated at the cap (docs/algorithm.md §5.1 reports this script's output).

Usage: python benchmarks/bench_tis_ratio.py [--responses 10000] [--length 4096] [--cap 2]
"""

from __future__ import annotations

import argparse

import torch


def _gaps(gen: torch.Generator, n: int, length: int, bias: float) -> torch.Tensor:
    big = torch.rand(n, length, generator=gen) < 0.02
    small = 5e-4 * torch.randn(n, length, generator=gen)
    return (torch.where(big, 0.08 * torch.randn(n, length, generator=gen), small) + bias).double()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", type=int, default=10_000)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--cap", type=float, default=2.0)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    for bias in (0.0, -1e-4):
        d = _gaps(gen, args.responses, args.length, bias)
        total = d.sum(1)
        print(
            f"bias {bias:g} per token: mean |gap| {d.abs().mean():.2e}, max {d.abs().max():.2f}; "
            f"|response gap| median {total.abs().median():.2f}, p95 {total.abs().quantile(0.95):.2f} nat"
        )
        for name, log_ratio in (("sequence", total), ("geometric", total / args.length)):
            w = log_ratio.exp()
            q = torch.quantile(w, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
            capped = w.clamp(max=args.cap)
            print(
                f"  {name:9s} weight p5 {q[0]:.5f} p50 {q[1]:.5f} p95 {q[2]:.5f}; truncated "
                f"{float((w > args.cap).double().mean()):.1%}; mean after the cap {capped.mean():.3f}, sd "
                f"{capped.std():.3f}"
            )


if __name__ == "__main__":
    main()
