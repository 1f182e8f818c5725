"""Triton kernels for the selected-token log-prob over one rank's vocabulary shard (docs/architecture.md §3, mcore).

Two kernels, one program per token row, each a single pass over the row's ``Vp`` logits in ``BLOCK``-wide tiles:

- ``shard_stats``: the online (running-max) softmax statistics of ``x = logits / temperature`` over the shard, the
  row max ``m``, ``s = sum exp(x - m)``, ``t = sum exp(x - m) * (x - m)`` (for the entropy only) and the label's ``x``
  when this rank owns the label. The bf16 logits are read once and never copied to fp32 in memory.
- ``shard_grad``: ``d/dx = g * (onehot(label) - p) - h * p * (x - E_p[x])`` divided by the temperature, with
  ``p = exp(x - lse)``, written straight into a gradient of the logits' dtype.

The tensor-parallel combination of the per-rank statistics (an all-reduce of ``m`` with MAX, then of the rescaled
sums with SUM) happens in torch on ``[T]`` vectors (``logprobs.py``). Triton is optional: ``available`` says whether
these kernels can run on a device (CUDA, or any device under ``TRITON_INTERPRET=1``, Triton's CPU interpreter).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the chunked torch path runs instead
    triton = None
    tl = None

__all__ = ["available", "shard_grad", "shard_stats"]

# Tile width over the vocabulary: 4,096 bf16 logits = 8 KiB per load, 4 tiles per 16 K of vocabulary per row.
_MAX_BLOCK = 4096


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device`` (Triton imports and the device is CUDA, or Triton's CPU
    interpreter is switched on with ``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _stats_kernel(
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

    @triton.jit
    def _grad_kernel(
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


def _launch_args(vp: int) -> tuple[int, int]:
    assert triton is not None
    block = min(triton.next_power_of_2(vp), _MAX_BLOCK)
    return block, 8 if block >= 2048 else 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to(torch.float32).contiguous()


def shard_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row softmax statistics of ``logits / temperature`` over this rank's shard.

    Args:
        logits: ``[T, Vp]`` bf16/fp16/fp32 logits with unit stride along the vocabulary.
        labels: ``[T]`` int64 global token ids.
        vocab_start: The global id of this shard's first entry.
        temperature: Divides the logits.
        with_entropy: Also return ``t = sum exp(x - m) * (x - m)``.

    Returns:
        ``[T]`` fp32 each: the shard max ``m``, ``s = sum exp(x - m)``, the label's ``x`` (0 where this rank does not
        own the label), and ``t`` (None without ``with_entropy``).
    """
    num_tokens, vp = logits.shape
    new = logits.new_empty
    m, s, target = (new(num_tokens, dtype=torch.float32) for _ in range(3))
    t = new(num_tokens, dtype=torch.float32) if with_entropy else None
    if num_tokens:
        block, warps = _launch_args(vp)
        _stats_kernel[(num_tokens,)](
            logits,
            logits.stride(0),
            labels.contiguous(),
            vocab_start,
            vp,
            temperature,
            m,
            s,
            target,
            s if t is None else t,
            BLOCK=block,
            ENTROPY=with_entropy,
            num_warps=warps,
        )
    return m, s, target, t


def shard_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    temperature: float,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    mean_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of ``sum(g * logp + h * entropy)`` with respect to this rank's logits shard.

    Args:
        logits: ``[T, Vp]`` the forward's logits (unit stride along the vocabulary).
        labels: ``[T]`` int64 global token ids.
        vocab_start: The global id of this shard's first entry.
        temperature: Divides the logits.
        lse: ``[T]`` the global logsumexp of ``logits / temperature`` (all TP ranks combined).
        grad_logp: ``[T]`` upstream gradient ``g`` of the log-probs.
        grad_entropy: ``[T]`` upstream gradient ``h`` of the entropies, or None.
        mean_x: ``[T]`` ``E_p[x]`` (needed with ``grad_entropy``).

    Returns:
        ``[T, Vp]`` in the logits' dtype, contiguous.
    """
    num_tokens, vp = logits.shape
    grad = torch.empty((num_tokens, vp), dtype=logits.dtype, device=logits.device)
    entropy = grad_entropy is not None
    if entropy and mean_x is None:
        raise ValueError("shard_grad: grad_entropy needs mean_x, the forward's E_p[x]")
    if num_tokens:
        block, warps = _launch_args(vp)
        g = _rows(grad_logp)
        h, mean = (_rows(grad_entropy), _rows(mean_x)) if grad_entropy is not None and mean_x is not None else (g, g)
        _grad_kernel[(num_tokens,)](
            logits,
            logits.stride(0),
            grad,
            grad.stride(0),
            labels.contiguous(),
            vocab_start,
            vp,
            temperature,
            _rows(lse),
            g,
            h,
            mean,
            BLOCK=block,
            ENTROPY=entropy,
            num_warps=warps,
        )
    return grad
