"""The Triton kernels behind ``fused_logprobs.py`` (imported only where Triton is installed; maths documented
there and in docs/architecture.md §3, mcore)."""

from typing import Any

import triton
import triton.language as tl

__all__ = ["grad_kernel", "stats_kernel"]


def _stats(
    logits_ptr,
    row_stride,
    labels_ptr,
    vocab_start,
    vp,
    temperature,
    max_ptr,
    sum_ptr,
    target_ptr,
    xsum_ptr,
    BLOCK: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    # A finite start (no logit is below it) keeps (m - m_new) * s free of -inf * 0 on the first tile.
    m = tl.zeros([], dtype=tl.float32) - 1e30
    s = tl.zeros([], dtype=tl.float32)
    t = tl.zeros([], dtype=tl.float32)
    for start in range(0, vp, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vp
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Online softmax: rescale what was summed against the old max to the new one.
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        if ENTROPY:
            # t = sum e * (x - m) moves with m too: sum e' * (x - m_new) = scale * (t + (m - m_new) * s).
            t = scale * (t + (m - m_new) * s) + tl.sum(e * tl.where(mask, x - m_new, 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    local = tl.load(labels_ptr + row) - vocab_start
    owned = (local >= 0) & (local < vp)
    target = tl.load(base + local, mask=owned, other=0.0).to(tl.float32) / temperature
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(target_ptr + row, tl.where(owned, target, 0.0))
    if ENTROPY:
        tl.store(xsum_ptr + row, t)


def _grad(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_row_stride,
    labels_ptr,
    vocab_start,
    vp,
    temperature,
    lse_ptr,
    g_ptr,
    h_ptr,
    mean_ptr,
    BLOCK: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * grad_row_stride
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    local = tl.load(labels_ptr + row) - vocab_start
    if ENTROPY:
        h = tl.load(h_ptr + row)
        mean = tl.load(mean_ptr + row)
    for start in range(0, vp, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vp
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) / temperature
        p = tl.exp(x - lse)
        if ENTROPY:
            coef = g + h * (x - mean)  # d logp/dx = onehot - p;  d H/dx = -p * (x - E_p[x])
        else:
            coef = g
        d = (tl.where(cols == local, g, 0.0) - p * coef) / temperature
        tl.store(out + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)  # downcast rounds to nearest even


# Compiled per (BLOCK, ENTROPY) and dtype on first launch; plain names so callers index them as kernel[grid](...).
stats_kernel: Any = triton.jit(_stats)
grad_kernel: Any = triton.jit(_grad)
