"""Packed-sequence parameters and the lean local softmax (GPU numerics, checked on CPU), and the varlen path (GPU)."""

import pytest
import torch

from megatron_pacs.mcore.attention import LeanScaleMaskSoftmax, packed_sequences


def test_packed_parameters_give_the_tail_padding_to_the_last_sequence():
    p = packed_sequences((3, 5), 12, torch.device("cpu"), host=True)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 3, 8] and p.cu_seqlens_q_padded.tolist() == [0, 3, 12]
    assert p.max_seqlen_q == 9 and p.seqlens == (3, 5) and p.total == 12
    assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_device is None
    empty = packed_sequences((), 4, torch.device("cpu"), host=True)
    assert empty.cu_seqlens_q.tolist() == [0, 4] and empty.seqlens == ()  # a padding-only row: one dummy sequence
    with pytest.raises(ValueError, match="do not fit a packed row of 7"):
        packed_sequences((3, 5), 7, torch.device("cpu"), host=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_softmax_matches_megatrons_unfused_softmax_and_its_gradient(dtype):
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 3, 7, 7, generator=gen) * 4).to(dtype).requires_grad_()
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)[None, None]
    out = LeanScaleMaskSoftmax(scale=0.5)(scores, mask)
    ref_in = scores.detach().float().requires_grad_()
    ref = torch.softmax((ref_in * 0.5).masked_fill(mask, -10000.0), -1)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(grad)
    ref.backward(grad.float())
    torch.testing.assert_close(scores.grad.float(), ref_in.grad, atol=tol * 5, rtol=tol * 5)
    auto = LeanScaleMaskSoftmax(scale=None)(scores.detach(), None)  # causal mask built when none is given
    torch.testing.assert_close(
        auto.float(), torch.softmax(scores.detach().float().masked_fill(mask, -1e4), -1), atol=tol, rtol=tol
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash varlen attention)")
def test_gpu_sdpa_varlen_path_equals_one_sdpa_call_per_sequence():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_pacs.mcore import attention

    # without torch's varlen kernel both sides would be the per-sequence path and the test would prove nothing
    assert attention._varlen_kwargs() is not None, f"torch {torch.__version__} has no varlen_attn"

    class _Cfg:  # the fields SDPAttention reads (a TransformerConfig needs a parallel state)
        context_parallel_size, attention_dropout, kv_channels = 1, 0.0, 64

    module = attention.SDPAttention.__new__(attention.SDPAttention)
    torch.nn.Module.__init__(module)
    module.attn_mask_type, module.dropout_p, module.scale = AttnMaskType.causal, 0.0, 0.125
    lens, total = (37, 100, 5), 160
    q = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fast = module._packed(q, k, v, attention.packed_sequences(lens, total, torch.device("cuda"), host=True))
    slow = torch.zeros_like(fast)
    start = 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].permute(1, 0, 2)[None] for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True)
        slow[start : start + n] = o[0].permute(1, 0, 2).reshape(n, -1)
        start += n
    torch.testing.assert_close(fast, slow, atol=2e-2, rtol=2e-2)
    assert fast[sum(lens) :].abs().max().item() == 0.0
