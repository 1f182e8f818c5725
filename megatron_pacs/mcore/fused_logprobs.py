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

import importlib.util
import os
from functools import cache

import torch

__all__ = ["available", "shard_grad", "shard_stats"]

# Tile width over the vocabulary: 4,096 bf16 logits = 8 KiB per load, 4 tiles per 16 K of vocabulary per row.
_MAX_BLOCK = 4096


@cache
def triton_installed() -> bool:
    """Whether Triton can be imported (the CPU install has none: the chunked torch path runs there)."""
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device`` (Triton is installed and the device is CUDA, or Triton's CPU
    interpreter is switched on with ``TRITON_INTERPRET=1``)."""
    if not triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _launch_args(vp: int) -> tuple[int, int]:
    block = min(1 << max(vp - 1, 0).bit_length(), _MAX_BLOCK)  # the next power of two, capped
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
        from megatron_pacs.mcore._logprob_kernels import stats_kernel

        stats_kernel[(num_tokens,)](
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
        from megatron_pacs.mcore._logprob_kernels import grad_kernel

        grad_kernel[(num_tokens,)](
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
