"""Core attention for the sdpa and local layer specs, padded or packed, and the packed-sequence parameters.

A packed micro-batch is one row of ``T`` tokens holding m sequences one after another, then padding
(docs/algorithm.md §4.4). Megatron passes it through the model in the ``thd`` format: queries/keys/values
``[T, heads, d]`` and a :class:`PackedSequences` (Megatron's ``PackedSeqParams`` plus the lengths on the host)
whose ``cu_seqlens`` restart RoPE at every sequence and confine attention to it.

- Transformer Engine's attention reads the ``thd`` parameters itself; the tail padding is declared as padding of the
  last sequence (``cu_seqlens_*_padded``), so no attention is computed over it.
- :class:`SDPAttention` (sdpa spec): padded rows through ``F.scaled_dot_product_attention``; packed rows through
  ``torch.nn.attention.varlen.varlen_attn`` (one flash kernel) on CUDA where torch has it, else one causal SDPA
  call per sequence. Either way no ``[T, T]`` score matrix exists.
- :class:`LocalAttention` (local spec): Megatron's ``DotProductAttention``, called once per sequence of a packed
  row with that sequence's causal mask (scores ``[l_i, l_i]`` per sequence, never ``[T, T]``); unchanged on padded
  rows. On GPU its softmax keeps only the bf16 probabilities for the backward (:class:`_LeanSoftmax`), as Apex's
  fused masked softmax does, so the local spec fits seq 4,096 x batch 2 at 1.5B without Apex.

The output at padding positions is 0: nothing reads it (scores come from real tokens only).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "LeanScaleMaskSoftmax",
    "LocalAttention",
    "PackedSequences",
    "SDPAttention",
    "packed_sequences",
    "uses_own_attention",
]


@dataclass
class PackedSequences(PackedSeqParams):
    """Megatron's ``thd`` parameters plus what the project's own attentions need without a device sync.

    ``cu_seqlens_q/kv`` count the real tokens of each sequence; ``cu_seqlens_*_padded`` give the last sequence the
    row's tail padding (Transformer Engine skips it; RoPE positions follow the padded offsets).
    """

    seqlens: tuple[int, ...] = ()
    """The real sequences' lengths (host ints), in row order."""
    total: int = 0
    """T, the row's length with padding."""
    cu_seqlens_device: torch.Tensor | None = None
    """int32 ``[m + 1]`` real-sequence offsets on the accelerator, for varlen kernels (None on CPU)."""


def packed_sequences(seqlens: tuple[int, ...], total: int, device: torch.device, *, host: bool) -> PackedSequences:
    """The ``thd`` parameters of a packed row.

    Args:
        seqlens: Lengths of the row's real sequences, in order (may be empty: a row of padding only).
        total: T, the row's length (>= sum of ``seqlens``).
        device: Where the model runs.
        host: Keep ``cu_seqlens`` on the host (the project's own attentions and Megatron's unfused RoPE then need
            no device sync); False for Transformer Engine, whose kernels read them on the device.
    """
    used = sum(seqlens)
    if used > total:
        raise ValueError(f"sequences of {used} tokens do not fit a packed row of {total}")
    # A row of padding only is one padding "sequence" for the attention kernels (no real one is scored).
    real = list(seqlens) or [total]
    padded = [*real[:-1], real[-1] + total - sum(real)]
    where = torch.device("cpu") if host else device

    def cu(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=where)

    on_accelerator = device.type != "cpu"
    return PackedSequences(
        qkv_format="thd",
        cu_seqlens_q=cu(real),
        cu_seqlens_kv=cu(real),
        cu_seqlens_q_padded=cu(padded),
        cu_seqlens_kv_padded=cu(padded),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        seqlens=tuple(seqlens),
        total=total,
        cu_seqlens_device=cu(real).to(device) if on_accelerator and host else None,
    )


# Keyed by the module itself, weakly: an id() key could be reused by a later model (a reference built after the
# actor, a stacked pair of chunks) and answer for the wrong spec.
_OWN_ATTENTION: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def uses_own_attention(model: torch.nn.Module) -> bool:
    """True when ``model``'s (possibly DDP-wrapped) core attention is :class:`SDPAttention` or
    :class:`LocalAttention` rather than Transformer Engine's: packed boundaries then stay on the host."""
    own = _OWN_ATTENTION.get(model)
    if own is None:
        own = _OWN_ATTENTION[model] = any(isinstance(m, SDPAttention | LocalAttention) for m in model.modules())
    return own


def _segments(params: PackedSequences) -> list[tuple[int, int]]:
    out, start = [], 0
    for length in params.seqlens:
        out.append((start, length))
        start += length
    return out


def _varlen_kwargs() -> dict[str, Any] | None:
    """How this torch's ``varlen_attn`` asks for a causal mask and GQA, or None where it has no such function (a
    fresh dict per call: the caller edits it)."""
    found = _varlen_signature()
    return None if found is None else dict(found)


@functools.cache
def _varlen_signature() -> dict[str, Any] | None:
    # inspect.signature costs ~30 us: once per process, not once per layer and micro-batch
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    names = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "is_causal" in names:
        kwargs["is_causal"] = True
    elif "window_size" in names:
        kwargs["window_size"] = (-1, 0)
    else:
        return None
    kwargs["gqa"] = "enable_gqa" in names
    return kwargs


class SDPAttention(MegatronModule):
    """Megatron core attention through ``F.scaled_dot_product_attention`` (flash / cuDNN / efficient kernels).

    Same interface as Megatron's ``DotProductAttention``: query ``[sq, b, heads, d]``, key/value
    ``[sk, b, groups, d]`` (GQA), returns ``[sq, b, heads * d]``; packed (``thd``): ``[T, heads, d]`` in,
    ``[T, heads * d]`` out. The mask follows Megatron (True = masked).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("the SDPA attention spec does not support context parallelism; use the TE spec")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            assert config.kv_channels is not None  # TransformerConfig.__post_init__ fills it in
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("the SDPA attention spec does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and (attention_mask is None or q.shape[2] == k.shape[2])
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal or attention_mask is None else ~attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _packed(self, query, key, value, params: PackedSequences) -> torch.Tensor:
        """``[T, heads, d]`` -> ``[T, heads * d]``, causal within each sequence, 0 on the tail padding."""
        if not isinstance(params, PackedSequences):
            raise ValueError("packed rows need megatron_pacs.mcore.attention.PackedSequences parameters")
        total, heads, dim = query.shape
        out = query.new_zeros(total, heads * dim)
        used = sum(params.seqlens)
        if not used:
            return out
        dropout = self.dropout_p if self.training else 0.0
        varlen = _varlen_kwargs() if query.is_cuda and dropout == 0.0 else None
        if varlen is not None and params.cu_seqlens_device is not None and query.dtype != torch.float32:
            from torch.nn.attention.varlen import varlen_attn

            q, k, v = query[:used], key[:used], value[:used]
            if not varlen.pop("gqa") and k.shape[1] != heads:
                k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
            elif k.shape[1] != heads:
                varlen["enable_gqa"] = True
            longest = max(params.seqlens)
            cu = params.cu_seqlens_device
            o = varlen_attn(q, k, v, cu, cu, longest, longest, scale=self.scale, **varlen)
            assert isinstance(o, torch.Tensor)  # a tuple only when the log-sum-exp is asked for
            out[:used] = o.reshape(used, heads * dim)
            return out
        for start, length in _segments(params):
            q, k, v = (t[start : start + length].permute(1, 0, 2)[None] for t in (query, key, value))
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != heads
            )
            out[start : start + length] = o[0].permute(1, 0, 2).reshape(length, heads * dim)
        return out


class _LeanSoftmax(torch.autograd.Function):
    """softmax(scale * x masked) in fp32, returning and saving only the input-dtype probabilities.

    Autograd through ``x.float().softmax()`` keeps the fp32 probabilities ([b, heads, s, s] x 4 bytes per layer);
    the backward ``dx = y * (dy - sum(dy * y))`` needs only y, so keeping y in bf16 halves that (Apex's fused kernel
    does the same).
    """

    @staticmethod
    def forward(ctx, scores, mask, scale):
        x = scores.float() * scale
        if mask is not None:
            x = x.masked_fill(mask, -10000.0)  # Megatron's attention_mask_func value
        probs = torch.softmax(x, dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        y = probs.float()
        g = grad.float()
        dx = y * (g - (g * y).sum(-1, keepdim=True)) * ctx.scale
        return dx.to(probs.dtype), None, None


class LeanScaleMaskSoftmax(torch.nn.Module):
    """Drop-in for Megatron's ``FusedScaleMaskSoftmax`` on its unfused path (``[b, heads, sq, sk]`` scores, a
    causal mask built when None), through :class:`_LeanSoftmax`."""

    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None, softmax_offset: Any = None) -> torch.Tensor:
        if softmax_offset is not None:
            raise ValueError("the lean local softmax does not support a softmax offset")
        if mask is None:
            s = scores.shape[-1]
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=scores.device), 1)
        return _LeanSoftmax.apply(scores, mask, 1.0 if self.scale is None else float(self.scale))


class LocalAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention``, extended to packed rows (one call per sequence).

    On padded rows it is exactly Megatron's. On GPU with bf16/fp16 and no Apex kernel, the scale-mask-softmax keeps
    only the low-precision probabilities for the backward (:class:`_LeanSoftmax`).
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._masks: dict[int, torch.Tensor] = {}
        if torch.cuda.is_available() and (config.bf16 or config.fp16) and not config.masked_softmax_fusion:
            # The query-key layer-scaling coefficient (or None) stays what Megatron computed.
            self.scale_mask_softmax = LeanScaleMaskSoftmax(self.scale_mask_softmax.scale)

    def _causal(self, length: int, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(length)
        if mask is None or mask.device != device:
            mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]
            self._masks = {length: mask} if len(self._masks) > 64 else {**self._masks, length: mask}
        return mask

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if not isinstance(packed_seq_params, PackedSequences):
            raise ValueError("packed rows need megatron_pacs.mcore.attention.PackedSequences parameters")
        total = query.shape[0]
        pieces = []
        for start, length in _segments(packed_seq_params):
            q, k, v = (t[start : start + length].unsqueeze(1) for t in (query, key, value))
            o = super().forward(q, k, v, self._causal(length, query.device), attn_mask_type, attention_bias)
            pieces.append(o.squeeze(1))
        used = sum(packed_seq_params.seqlens)
        if used < total:
            pieces.append(query.new_zeros(total - used, self.hidden_size_per_partition))
        return torch.cat(pieces)
