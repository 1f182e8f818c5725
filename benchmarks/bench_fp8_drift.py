#!/usr/bin/env python
"""PACS score error of each FP8 option against an fp32 reference, and the time of a score pass (GPU).

A PACS score is ``s = beta * sum_t (log pi_theta - log pi_anchor)`` over a response (docs/algorithm.md §2.1); its
two terms are forward-only log-prob passes at two nearby weight sets. FP8 moves each token's log-prob by a small,
partly systematic amount; what matters is how much of that survives in ``s``. Method:

1. The anchor: a random-init model of ``--shape`` trained ``--train-steps`` steps (bf16, AdamW lr 1e-4, clip 1) on
   periodic token sequences, so that its distributions are peaked as a trained LM's are, not near-uniform. theta:
   the anchor after ``--theta-steps`` more steps. Both are written as HF directories.
2. Each option builds a frozen ``Actor`` (no optimizer) from the anchor, takes the token log-probs of
   ``--sequences`` x ``--length`` tokens (the training pattern), loads theta's weights in place and takes them again.
3. Per sequence and per option: the score error ``|s_option - s_fp32|`` (beta = 1) summed over the first 1,024 and
   over all tokens; the log-prob sum's own drift ``|sum_t (log pi_theta)_option - (log pi_theta)_fp32|`` (what the
   engine-vs-trainer consistency metrics see); the mean signed per-token difference (a bias, if not ~0); and the
   median time of one score pass (CUDA events, after a warm-up that also fills the delayed recipe's amax history).

Options (rows), per ``--recipes``: ``bf16`` (no FP8, the baseline the safe mode must not be worse than);
``A`` FP8 everywhere (``--fp8-score-precision fp8``); ``B`` FP8 training, bf16 score passes (the default);
``C`` FP8 with the first and last layers in bf16 (``--first-last-layers-bf16``; not with the delayed recipe);
``B+C``. The reference is fp32 on the sdpa spec (exact against HF to ~1e-5). The training step's fwd+bwd time per
precision is in ``bench_train_step.py --fp8 ...``; a PACS step is one fwd+bwd plus two score passes.

Usage (GPU with Transformer Engine): python benchmarks/bench_fp8_drift.py [--shape 1.5b] [--recipes delayed
tensorwise blockwise]; ``--shape tiny --options bf16`` runs the logic on a CPU (bf16 vs fp32 only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import make_model_dir

OPTIONS = {
    # name: (FP8 on, scores in FP8, first/last layers in bf16)
    "bf16": (False, False, False),
    "A": (True, True, False),
    "B": (True, False, False),
    "C": (True, True, True),
    "B+C": (True, False, True),
}


def _periodic(n: int, length: int, period: int, vocab: int, seed: int):
    import torch

    pattern = torch.randint(2, vocab, (n, period), generator=torch.Generator().manual_seed(seed))
    return pattern.repeat(1, length // period + 1)[:, :length].contiguous()


def _micro_batches(tokens):
    import torch

    from megatron_pacs.algo.tokens import MicroBatch

    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 0] = False  # every token but the first is scored: one "response" of L - 1 tokens per row
    return [MicroBatch(tokens[i : i + 1], mask[i : i + 1], torch.tensor([i])) for i in range(tokens.shape[0])]


def _train_anchor(args, base_dir: Path, work: Path, groups, tokens) -> tuple[str, str]:
    import torch

    from megatron_pacs.config import ModelConfig, OptimConfig
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.model_checkpoint import save_hf_checkpoint

    gpu = torch.cuda.is_available()
    model = ModelConfig(hf_model=str(base_dir), bf16=gpu, transformer_impl=args.impl)
    actor = Actor(model, groups, OptimConfig(lr=1e-4, clip_grad=1.0, use_distributed_optimizer=gpu))
    mbs = _micro_batches(tokens)

    def nll(scored):
        return -scored.logp.sum(), torch.tensor(scored.num_sequences, dtype=torch.int), {}

    work.mkdir(parents=True, exist_ok=True)
    dirs = []
    for name, steps in (("anchor", args.train_steps), ("theta", args.theta_steps)):
        for i in range(steps):
            result = actor.optimizer_step(mbs, nll)
            print(f"{name} step {i}: grad norm {result.grad_norm:.3g}", flush=True)
        out = work / name
        save_hf_checkpoint(actor.export_hf_weights(), out, side_files_from=base_dir, progress=False)
        dirs.append(str(out))
    del actor
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return dirs[0], dirs[1]


def _timed_logprobs(actor, mbs, lens, fp8: bool, iters: int):
    import time

    import torch

    times, out = [], None
    for i in range(iters + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = actor.logprobs(mbs, lens, tokens=True, fp8=fp8)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:  # the first pass warms up (kernels, Triton, the delayed recipe's amax history)
            times.append(time.perf_counter() - t0)
    assert out is not None and out.tokens is not None
    logp = torch.stack([out.tokens.response(j) for j in range(lens.numel())]).double().cpu()
    return logp, statistics.median(times)


def evaluate(option: str, recipe: str | None, anchor: str, theta: str, groups, tokens, args) -> dict:
    """Token log-probs ``[N, L - 1]`` at the anchor and at theta under one option, and the score-pass time."""
    import torch

    from megatron_pacs.config import ModelConfig
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.weights import load_hf_weights

    if option == "fp32":
        kwargs = {"bf16": False, "transformer_impl": "local" if args.impl == "local" else "sdpa"}
        fp8_scores = False
    else:
        fp8, fp8_scores, first_last = OPTIONS[option]
        kwargs = {"bf16": True, "transformer_impl": args.impl}
        if fp8:
            kwargs |= {"fp8_format": "hybrid", "fp8_recipe": recipe, "first_last_layers_bf16": first_last}
            kwargs["fp8_score_precision"] = "fp8" if fp8_scores else "bf16"
    model = ModelConfig(hf_model=anchor, **kwargs)
    actor = Actor(model, groups, None)
    mbs = _micro_batches(tokens)
    lens = torch.full((tokens.shape[0],), tokens.shape[1] - 1)
    at_anchor, seconds = _timed_logprobs(actor, mbs, lens, fp8_scores, args.iters)
    load_hf_weights(actor.models, theta, groups, actor.hf_config)
    at_theta, _ = _timed_logprobs(actor, mbs, lens, fp8_scores, args.iters)
    del actor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"anchor": at_anchor, "theta": at_theta, "seconds": seconds}


def errors(got: dict, ref: dict) -> dict:
    """Score and sum errors (nats) of ``got`` against the fp32 ``ref``, at 1,024 tokens and at the full length."""
    d_theta, d_anchor = got["theta"] - ref["theta"], got["anchor"] - ref["anchor"]
    out = {"bias": d_theta.mean().item(), "seconds": got["seconds"]}
    for k, cut in (("1k", 1024), ("all", d_theta.shape[1])):
        score = (d_theta[:, :cut] - d_anchor[:, :cut]).sum(-1).abs()
        drift = d_theta[:, :cut].sum(-1).abs()
        out.update({f"score_{k}_mean": score.mean().item(), f"score_{k}_max": score.max().item()})
        out.update({f"sum_{k}_mean": drift.mean().item(), f"sum_{k}_max": drift.max().item()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import torch

    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", default="1.5b" if gpu else "tiny")
    ap.add_argument("--impl", default="te" if gpu else "local", help="layer spec of the bf16/FP8 rows")
    ap.add_argument("--recipes", nargs="*", default=["delayed", "tensorwise", "blockwise"])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096 if gpu else 256)
    ap.add_argument("--period", type=int, default=256 if gpu else 16)
    ap.add_argument("--train-steps", type=int, default=10)
    ap.add_argument("--theta-steps", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3, help="timed score passes (median)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mpacs_bench"))
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()

    from transformers import AutoConfig

    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.parallel import init_parallel

    groups = init_parallel(ParallelConfig())
    work = Path(args.workdir)
    base = make_model_dir(args.shape, work)
    vocab = AutoConfig.from_pretrained(base).vocab_size
    tokens = _periodic(args.sequences, args.length, args.period, vocab, seed=11)
    anchor, theta = _train_anchor(args, base, work / f"drift_{args.shape}", groups, tokens)
    ref = evaluate("fp32", None, anchor, theta, groups, tokens, args)
    runs = [(o, None) for o in args.options if not OPTIONS[o][0]]
    # Transformer Engine's delayed recipe cannot keep layers in bf16 (ModelConfig refuses it): no C rows there.
    runs += [
        (o, r) for r in args.recipes for o in args.options if OPTIONS[o][0] and not (OPTIONS[o][2] and r == "delayed")
    ]
    rows = []
    for option, recipe in runs:
        try:
            rows.append(
                {
                    "option": option,
                    "recipe": recipe,
                    **errors(evaluate(option, recipe, anchor, theta, groups, tokens, args), ref),
                }
            )
        except Exception as exc:  # noqa: BLE001 - a recipe the GPU lacks is reported, the other rows still run
            rows.append({"option": option, "recipe": recipe, "error": f"{type(exc).__name__}: {exc}"[:200]})
    base_row = next((r for r in rows if r["option"] == "bf16" and "error" not in r), None)
    print(f"PACS score error vs fp32 (sdpa), {args.shape}, {args.sequences} x {args.length} tokens, nats, beta = 1")
    print(
        "| option | recipe | score err 1k mean / max | score err all mean / max | sum drift all mean / max | "
        "token bias | score pass ms | vs bf16 time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['option']} | {r['recipe'] or '-'} | failed: {r['error']} |")
            continue
        vs = f"{base_row['seconds'] / r['seconds']:.2f}x" if base_row else "-"
        print(
            f"| {r['option']} | {r['recipe'] or '-'} | {r['score_1k_mean']:.3g} / {r['score_1k_max']:.3g} | "
            f"{r['score_all_mean']:.3g} / {r['score_all_max']:.3g} | {r['sum_all_mean']:.3g} / "
            f"{r['sum_all_max']:.3g} | {r['bias']:.2e} | {r['seconds'] * 1e3:.0f} | {vs} |"
        )
    print("baseline: 'bf16' (no FP8); score pass = one forward-only log-prob pass over all sequences")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
