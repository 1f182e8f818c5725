"""Row offsets past 2**31 elements in the fused log-prob kernels, run by tests/mcore/test_fused_logprobs.py under
``TRITON_INTERPRET=1`` (the interpreter computes in numpy's fixed-width integers, so an int32 offset wraps as on
the GPU).

A full ``[32768, 151936]`` logits tensor (T x V > 2**31: row 14,135 starts past 2**31) is 10 GB in bf16. The same
arithmetic, ``row * row_stride`` with an int32 stride whose product leaves int32, is reached with three rows lying
``ROW_STRIDE = 2**30 + 4099`` elements apart: row 2 starts at 2**31 + 8198. The buffers are allocated, not
touched (Linux maps their pages on first write), so only the three rows are ever resident. Writes
``{name: value}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource

import torch

from megatron_pacs.mcore import fused_logprobs

VOCAB = 151_936  # Qwen2.5's vocabulary
ROW_STRIDE = 2**30 + 4099  # fits int32 (Triton passes it as i32); 2 * ROW_STRIDE does not
TEMPERATURE = 0.7


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """A ``[3, VOCAB]`` view with rows ROW_STRIDE apart in an untouched buffer."""
    buffer = torch.empty(2 * ROW_STRIDE + VOCAB, dtype=dtype)
    return buffer.as_strided((3, VOCAB), (ROW_STRIDE, 1))


def check() -> dict[str, float]:
    from megatron_pacs.mcore._logprob_kernels import grad_kernel

    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(3, VOCAB, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.tensor([5, VOCAB - 1, 123_456])
    logits = _rows(torch.bfloat16)
    logits.copy_(values)
    assert logits.stride(0) * 2 >= 2**31 > logits.stride(0)
    m, s, target, t = fused_logprobs.shard_stats(logits, labels, 0, TEMPERATURE, with_entropy=True)
    assert t is not None
    lse = m + s.log()
    ref = torch.log_softmax(values.double() / TEMPERATURE, -1)
    ref_lp = ref.gather(1, labels[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    out = {
        "logp": (target.double() - lse.double() - ref_lp).abs().max().item(),
        "entropy": (lse.double() - (t / s).double() - m.double() - ref_ent).abs().max().item(),
    }
    # The gradient kernel writes through a strided output as well (shard_grad allocates a contiguous one; the
    # kernel is called directly so that its output offset also passes 2**31).
    grad = _rows(torch.float32)
    g = torch.randn(3, generator=gen)
    grad_kernel[(3,)](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        labels,
        0,
        VOCAB,
        TEMPERATURE,
        lse.float().contiguous(),
        g,
        g,
        g,
        BLOCK=4096,
        ENTROPY=False,
        num_warps=8,
    )
    ref_grad = (torch.nn.functional.one_hot(labels, VOCAB).double() - ref.exp()) * g[:, None].double() / TEMPERATURE
    out["grad"] = (grad.double() - ref_grad).abs().max().item()
    out["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.out, "w") as f:
        json.dump(check(), f)


if __name__ == "__main__":
    main()
