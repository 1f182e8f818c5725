"""CPU engines in half precision against ``ONEDNN_MAX_CPU_ISA`` (megatron_pacs/config/cpu_isa.py): refused by the
trainer's validation (engines in this environment) and by the engine itself, before vLLM starts.

The processor's AMX is read through ``torch.cpu._is_amx_tile_supported()``, which these tests set both ways with
monkeypatch (a hardware feature: this machine's processor decides it otherwise); the abort the refusal prevents was
seen on a Sapphire Rapids machine: vLLM's first bfloat16 forward under ``ONEDNN_MAX_CPU_ISA=AVX2`` (SIGABRT)."""

import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.config.cpu_isa import half_engine_refusal


@pytest.fixture
def amx(monkeypatch):
    """The processor has AMX (stands in for CPUID)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_half_precision_against_a_cap_below_amx_is_refused_naming_the_variable_and_the_fixes(amx, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    for dtype in ("bfloat16", "float16", "half"):
        why = half_engine_refusal(dtype)
        assert why is not None and why.startswith(f"--rollout-dtype {dtype}: ")
        assert "ONEDNN_MAX_CPU_ISA=AVX2" in why and "--rollout-dtype float32" in why and "AVX512_CORE_AMX" in why
    assert half_engine_refusal("float32") is None
    for cap in ("AVX512_CORE_AMX", "avx10_1_512_amx_fp16", "ALL"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert half_engine_refusal("bfloat16") is None, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert half_engine_refusal("bfloat16") is None


def test_a_processor_without_amx_runs_half_precision_under_any_cap(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert half_engine_refusal("bfloat16") is None


def _files(tmp_path) -> list[str]:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (tmp_path / "train.jsonl").write_text("")
    return ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]


def test_the_trainer_refuses_local_cpu_engines_it_would_lose_before_anything_starts(amx, monkeypatch, tmp_path):
    """The local fleet's engines inherit this environment: refused at validation. Engines of a cluster of their own
    (--ray-address) run in theirs, and each refuses for itself (the next test)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    files = _files(tmp_path)
    with pytest.raises(ValueError, match=r"^--rollout-dtype bfloat16: .*ONEDNN_MAX_CPU_ISA=AVX2"):
        parse_config([*files, "--rollout-dtype", "bfloat16"]).validate(1)
    parse_config([*files, "--rollout-dtype", "float32"]).validate(1)
    parse_config([*files, "--rollout-dtype", "bfloat16", "--ray-address", "ray://h:10001"]).validate(1)


def test_the_engine_refuses_before_vllm_starts(amx, monkeypatch):
    pytest.importorskip("vllm", reason="the engine module imports vLLM")
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    with pytest.raises(ValueError, match=r"ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 switches off"):
        VLLMEngine("/no/such/model", dtype="bfloat16")  # refused before the folder is read
