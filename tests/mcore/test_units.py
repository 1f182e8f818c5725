"""Single-process checks of the Megatron layer: layout validation, config translation, log-probs at TP=1."""

import subprocess
import sys

import pytest
import torch

from megatron_pacs.config import ParallelConfig
from megatron_pacs.demo.tiny import tiny_hf_config
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs


def test_interleaved_pipeline_needs_overlap_settings():
    with pytest.raises(ValueError, match="silently computes wrong gradients"):
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    ok = ParallelConfig(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        overlap_p2p_comm=True,
        batch_p2p_comm=False,
    )
    assert ok.model_parallel_size == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_model_parallel_size": 0}, "--tensor-model-parallel-size: 0 must be >= 1"),
        ({"virtual_pipeline_model_parallel_size": 2}, "needs --pipeline-model-parallel-size >= 2"),
        ({"sequence_parallel": True}, "--sequence-parallel: needs --tensor-model-parallel-size > 1"),
    ],
)
def test_layout_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_world_size_must_divide():
    with pytest.raises(ValueError, match="world size 6 is not divisible"):
        ParallelConfig(tensor_model_parallel_size=4).data_parallel_size(6)
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(16) == 4


def test_config_translation_and_refusals():
    from megatron_pacs.mcore.model import hf_to_transformer_config, rope_settings

    cfg = hf_to_transformer_config(tiny_hf_config("qwen3", tied=True), ParallelConfig(tensor_model_parallel_size=2))
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and cfg.num_query_groups == 2 and cfg.kv_channels == 16
    q2 = hf_to_transformer_config(tiny_hf_config("qwen2"), ParallelConfig(), dtype=torch.bfloat16, recompute=True)
    assert q2.add_qkv_bias and q2.bf16 and q2.recompute_granularity == "full"
    assert rope_settings(tiny_hf_config("llama"))["rope_scaling"] is True
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        hf_to_transformer_config(tiny_hf_config("qwen2"), ParallelConfig(tensor_model_parallel_size=8))
    with pytest.raises(ValueError, match="must divide num_hidden_layers"):
        hf_to_transformer_config(tiny_hf_config("qwen2", layers=3), ParallelConfig(pipeline_model_parallel_size=2))
    bad = tiny_hf_config("llama")
    bad.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        rope_settings(bad)
    gpt = tiny_hf_config("qwen2")
    gpt.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        hf_to_transformer_config(gpt, ParallelConfig())


def test_vocab_logprobs_single_rank_matches_log_softmax_and_never_upcasts_whole_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 40, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9))
    lp = vocab_parallel_logprobs(logits, labels, None, chunk_size=5)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32 and lp.shape == (2, 9)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="must match the leading dims"):
        vocab_parallel_logprobs(logits, labels[:, :3])


def test_fusions_stay_off_on_cpu_and_explicit_requests_are_refused():
    from megatron_pacs.mcore.model import Fusions, resolve_fusions

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert resolve_fusions("local") == Fusions()  # the exact, unfused arithmetic
    with pytest.raises(ValueError, match="--bias-swiglu-fusion: needs CUDA"):
        resolve_fusions("local", bias_swiglu=True)
    with pytest.raises(ValueError, match="--rope-fusion: needs CUDA and the TE spec"):
        resolve_fusions("sdpa", rope=True)


def test_on_cpu_megatron_core_is_imported_with_its_fusions_compile_deferred_to_a_first_call():
    """mcore/cpu_support.py: megatron.core's ``jit_fuser`` compiles at a first call (which the refused fusions
    never make), so no process pays for TorchInductor's compiler at import; ``torch.compile`` is left as it was."""
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    probe = (
        "import sys, torch; original = torch.compile; import megatron_pacs.mcore.model; "
        "import megatron.core.jit as jit; "
        "assert torch.compile is original; assert jit.jit_fuser.__name__ == '_compile_on_first_call'; "
        "assert 'torch._inductor.compile_fx' not in sys.modules; "
        "double = jit.jit_fuser(backend='eager')(lambda x: 2 * x); "
        "assert torch.equal(double(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused rms_norm path)")
def test_gpu_rms_norm_fused_path_has_hf_numerics():
    from types import SimpleNamespace

    from megatron_pacs.mcore.model import HFRMSNorm

    norm = HFRMSNorm(SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=False), 512).cuda()  # type: ignore[arg-type]
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16) * 3
    ref = x.float()
    ref = norm.weight * (ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), ref, atol=1e-2, rtol=1e-2)


def test_fp8_on_a_spec_without_transformer_engine_is_refused():
    """Only TE's layers run FP8 GEMMs: the local and sdpa specs would run bf16 under an FP8 label."""
    from megatron_pacs.demo.tiny import tiny_hf_config
    from megatron_pacs.mcore.model import build_gpt_model

    for spec in ("local", "sdpa"):
        with pytest.raises(ValueError, match="needs the Transformer Engine spec"):
            build_gpt_model(tiny_hf_config("qwen2"), None, spec=spec, fp8="hybrid")  # type: ignore[arg-type]


def test_te_fp8_autocast_deprecation_is_filtered_by_its_message_only_where_te_has_autocast(monkeypatch):
    """Megatron-core 0.16 enters TE's fp8_autocast every layer and pass, and TE 2.20 deprecates it.
    Simulated Transformer Engine (not installed here): a module with ``autocast`` gets the filter for exactly that
    DeprecationWarning; one without it (an older TE, where fp8_autocast does not warn) gets none."""
    import sys
    import types
    import warnings

    from megatron_pacs.mcore.model import TE_FP8_AUTOCAST_DEPRECATION, silence_te_fp8_autocast_deprecation

    message = TE_FP8_AUTOCAST_DEPRECATION + " Use autocast(enabled=..., recipe=..., _graph=...) instead."
    te = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch = te_pytorch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pytorch)
    for has_autocast in (False, True):
        if has_autocast:
            te_pytorch.autocast = lambda **kw: None  # type: ignore[attr-defined]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert silence_te_fp8_autocast_deprecation() is has_autocast
            warnings.warn(message, DeprecationWarning, stacklevel=1)
            warnings.warn("fp8_model_init is deprecated and will be removed", DeprecationWarning, stacklevel=1)
            warnings.warn(message, UserWarning, stacklevel=1)
        expected = (
            ["fp8_model_init", "fp8_autocast"] if has_autocast else ["fp8_autocast", "fp8_model_init", "fp8_autocast"]
        )
        assert [str(w.message).split()[0] for w in seen] == expected
