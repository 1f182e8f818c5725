"""Token log-probs (and entropy) from vocab-parallel logits, never gathering the vocabulary.

With tensor parallelism the output layer leaves each rank a ``[T, V/TP]`` shard of the logits. For each chunk of
tokens this computes the max and the sum of exponentials locally, all-reduces them over the TP group (two
collectives per chunk), and picks the label's logit on the rank that owns it. Only chunk-sized fp32 buffers are
allocated: no full ``[T, V]`` tensor and no fp32 copy of the shard. The backward recomputes the softmax per chunk
from the saved logsumexp and needs no communication (Megatron's column-parallel output layer all-reduces the
input gradient itself).

Where Triton can run (CUDA, or ``TRITON_INTERPRET=1``), the same computation runs fused (``fused_logprobs.py``):
one read of the bf16 shard for the statistics, one read and one bf16 write for the gradient, no fp32 buffers.

Shapes: T tokens, Vp = V / TP vocabulary entries on this rank.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from megatron_pacs.mcore import fused_logprobs

__all__ = ["LogprobImpl", "vocab_parallel_logprobs"]

LogprobImpl = Literal["auto", "fused", "chunked"]
"""The kernel choice (``--logprob-impl``): Triton's fused kernels, the chunked torch path, or fused where it runs."""


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogProbs(torch.autograd.Function):
    # Two [chunk, Vp] work buffers are allocated once per call and reused by every chunk (in-place ops): fresh
    # chunk-sized allocations each iteration cost as much in page faults as the arithmetic itself.

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, chunk_size, temperature, with_entropy):
        num_tokens, vp = logits.shape
        cdt = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32 per chunk; fp64 stays fp64
        logp = logits.new_empty(num_tokens, dtype=cdt)
        lse = torch.empty_like(logp)
        mean_x = torch.empty_like(logp) if with_entropy else None
        entropy = torch.empty_like(logp) if with_entropy else None
        rows = min(chunk_size, num_tokens)
        xbuf, ebuf = logits.new_empty(rows, vp, dtype=cdt), logits.new_empty(rows, vp, dtype=cdt)
        for s in range(0, num_tokens, chunk_size):
            e = min(s + chunk_size, num_tokens)
            x, ex = xbuf[: e - s], ebuf[: e - s]
            x.copy_(logits[s:e])
            if temperature != 1.0:
                x.div_(temperature)
            m = x.amax(dim=-1)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            x.sub_(m[:, None])
            local = labels[s:e] - vocab_start
            owned = (local >= 0) & (local < vp)
            target = x.gather(1, local.clamp(0, vp - 1)[:, None]).squeeze(1) * owned
            torch.exp(x, out=ex)
            parts = [ex.sum(-1), target]
            if with_entropy:
                parts.append(ex.mul_(x).sum(-1))
            stats = torch.stack(parts)
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            log_z = torch.log(stats[0])
            logp[s:e] = stats[1] - log_z
            lse[s:e] = m + log_z
            if with_entropy:
                assert entropy is not None and mean_x is not None  # allocated above when with_entropy
                ex_shifted = stats[2] / stats[0]  # E_p[x - m]
                entropy[s:e] = log_z - ex_shifted
                mean_x[s:e] = ex_shifted + m
        ctx.save_for_backward(logits, labels, lse, *(() if mean_x is None else (mean_x,)))
        ctx.set_materialize_grads(False)  # an entropy only reported (detached) adds nothing to the backward
        ctx.vocab_start, ctx.chunk_size, ctx.temperature, ctx.cdt = vocab_start, chunk_size, temperature, cdt
        ctx.with_entropy = with_entropy
        if with_entropy:
            return logp, entropy
        return logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, labels, lse, *rest = ctx.saved_tensors
        mean_x = rest[0] if rest else None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logp is None:  # only the entropy reaches the loss
            grad_logp = torch.zeros_like(lse)
        num_tokens, vp = logits.shape
        grad = torch.empty_like(logits)
        rows = min(ctx.chunk_size, num_tokens)
        xbuf, pbuf = logits.new_empty(rows, vp, dtype=ctx.cdt), logits.new_empty(rows, vp, dtype=ctx.cdt)
        for s in range(0, num_tokens, ctx.chunk_size):
            e = min(s + ctx.chunk_size, num_tokens)
            x, p = xbuf[: e - s], pbuf[: e - s]
            x.copy_(logits[s:e])
            if ctx.temperature != 1.0:
                x.div_(ctx.temperature)
            torch.sub(x, lse[s:e, None], out=p).exp_()
            # d logp / dx = onehot(label) - p;  d H / dx = -p * (x - E_p[x]); so with upstream grads g, h:
            # dL/dx = g * onehot - p * (g + h * (x - E_p[x]))
            if use_entropy:
                assert mean_x is not None and grad_entropy is not None  # saved in forward when with_entropy
                p.mul_(x.sub_(mean_x[s:e, None]).mul_(grad_entropy[s:e, None]).add_(grad_logp[s:e, None]))
            else:
                p.mul_(grad_logp[s:e, None])
            p.neg_()
            local = labels[s:e] - ctx.vocab_start
            owned = (local >= 0) & (local < vp)
            p.scatter_add_(1, local.clamp(0, vp - 1)[:, None], (grad_logp[s:e] * owned)[:, None].to(p.dtype))
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            grad[s:e].copy_(p)
        return grad, None, None, None, None, None, None


class _FusedVocabParallelLogProbs(torch.autograd.Function):
    # The per-rank statistics come from one Triton pass; the TP combination is the same two all-reduces as the
    # chunked path, on [T] vectors: MAX of the shard maxima, then SUM of the sums rescaled to the global max.

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, temperature, with_entropy):
        m_local, s, target, t = fused_logprobs.shard_stats(logits, labels, vocab_start, temperature, with_entropy)
        m = m_local.clone()
        _all_reduce(m, dist.ReduceOp.MAX, group)
        scale = torch.exp(m_local - m)
        # Each rank's sum exp(x - m_r) * (x - m_r), moved to the global max m: scale * (t + (m_r - m) * s).
        moved = [] if t is None else [scale * (t + (m_local - m) * s)]
        stats = torch.stack([s * scale, target, *moved])
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        log_z = torch.log(stats[0])
        lse = m + log_z
        logp = stats[1] - lse
        saved, outputs = (), (logp,)
        if with_entropy:
            shifted = stats[2] / stats[0]  # E_p[x - m]
            saved, outputs = (shifted + m,), (logp, log_z - shifted)
        ctx.save_for_backward(logits, labels, lse, *saved)
        ctx.set_materialize_grads(False)  # an entropy only reported (detached) adds nothing to the backward
        ctx.vocab_start, ctx.temperature, ctx.with_entropy = vocab_start, temperature, with_entropy
        return outputs if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, labels, lse, *rest = ctx.saved_tensors
        mean_x = rest[0] if rest else None
        if not (ctx.with_entropy and grad_entropy is not None):
            grad_entropy = None
        if grad_logp is None:  # only the entropy reaches the loss
            grad_logp = torch.zeros_like(lse)
        grad = fused_logprobs.shard_grad(
            logits, labels, ctx.vocab_start, ctx.temperature, lse, grad_logp, grad_entropy, mean_x
        )
        return grad, None, None, None, None, None


def _resolve_impl(impl: str, logits: torch.Tensor) -> str:
    if impl not in ("auto", "fused", "chunked"):
        raise ValueError(f"impl={impl!r}: use 'auto', 'fused' or 'chunked'")
    fusable = fused_logprobs.available(logits.device) and logits.dtype != torch.float64
    if impl == "fused" and not fusable:
        triton = "installed" if fused_logprobs.triton_installed() else "absent"
        raise ValueError(
            f"impl='fused' needs Triton and CUDA (or TRITON_INTERPRET=1) and bf16/fp16/fp32 logits; got "
            f"{logits.dtype} on {logits.device} with Triton {triton}: use impl='auto' or 'chunked'"
        )
    if impl == "auto":
        return "fused" if fusable else "chunked"
    return impl


@overload
def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
    return_entropy: Literal[False] = False,
    impl: LogprobImpl = "auto",
) -> torch.Tensor: ...


@overload
def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
    return_entropy: Literal[True],
    impl: LogprobImpl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: LogprobImpl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: LogprobImpl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label under softmax(logits / temperature) over the full (sharded) vocabulary.

    Args:
        logits_shard: ``[..., Vp]`` this rank's contiguous slice of the vocabulary (rank r holds entries
            ``[r * Vp, (r + 1) * Vp)``), any float dtype; differentiable.
        labels: ``[...]`` global token ids.
        tp_group: The tensor-parallel group the vocabulary is split over (None or size 1: no split).
        chunk_size: Tokens per chunk; the fp32 working memory is two ``[chunk_size, Vp]`` buffers.
        temperature: Sampling temperature the log-probs refer to (the rollout's).
        return_entropy: Also return the entropy of each token's distribution (differentiable).
        impl: ``"fused"``: the Triton kernels (CUDA, or ``TRITON_INTERPRET=1``; not for float64 logits);
            ``"chunked"``: the torch path above (``chunk_size`` applies); ``"auto"``: fused where it can run.

    Returns:
        ``[...]`` log-probs, and ``[...]`` entropies when ``return_entropy``; float32 (float64 for float64
        logits).
    """
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match the leading dims of logits {tuple(logits_shard.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    lead = labels.shape
    vp = logits_shard.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    flat, flat_labels = logits_shard.reshape(-1, vp), labels.reshape(-1).long()
    if _resolve_impl(impl, logits_shard) == "fused":
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = _FusedVocabParallelLogProbs.apply(
            flat, flat_labels, tp_group, rank * vp, float(temperature), return_entropy
        )
    else:
        out = _VocabParallelLogProbs.apply(
            flat, flat_labels, tp_group, rank * vp, chunk_size, float(temperature), return_entropy
        )
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)
