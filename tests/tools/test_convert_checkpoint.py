"""tools/convert_checkpoint.py end to end: HF -> Megatron (TP=2; a Qwen3-MoE at TP=2 x EP=2) -> HF bitwise, and
clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

pytestmark = pytest.mark.slow

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"


def convert(*args, check=True):
    proc = subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _tiny(path: Path, family: str) -> Path:
    config = tiny_hf_config(family, tied=False, layers=2)
    build_tiny_model(str(path), config, seed=3, scale=2.0, tokenizer=build_tokenizer(vocab_size=400))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("convert") / "hf", "qwen2")


#: (TP, EP) there and back. qwen2 at TP=2, back at TP=1 (resharded); a Qwen3-MoE (qk-norm weights and untied like
#: Qwen3-8B; 8 experts) loaded at TP=2 x EP=2 on 4 ranks, where a TP group's ranks hold different experts (mbridge's
#: read on TP rank 0 and scatter gave TP rank 1 rank 0's experts), back at TP=1 x EP=1 (resharded). Dense Qwen3's
#: export at TP=2: tests/mcore/test_distributed.py; the MoE export at TP=2 and at EP=2: tests/mcore/test_moe.py.
LAYOUTS = {"qwen2": ((2, 1), (1, 1)), "qwen3_moe": ((2, 2), (1, 1))}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_round_trip_is_bitwise(family, hf_dir, tmp_path):
    if family != "qwen2":
        hf_dir = _tiny(tmp_path / "hf", family)
    (tp, ep), (back_tp, back_ep) = LAYOUTS[family]
    layout = ["--tensor-model-parallel-size", tp, "--expert-model-parallel-size", ep]
    convert("hf-to-mcore", "--hf-dir", hf_dir, "--out", tmp_path / "mc", *layout)
    assert (tmp_path / "mc" / "megatron_pacs.json").is_file()
    back = ["--tensor-model-parallel-size", back_tp, "--expert-model-parallel-size", back_ep]
    convert("mcore-to-hf", "--load", tmp_path / "mc", "--hf-config", hf_dir, "--out", tmp_path / "hf2", *back)
    a, b = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf2" / side).is_file(), side
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    AutoTokenizer.from_pretrained(tmp_path / "hf2")
    if family != "qwen2":
        return  # the refusal below is the same for every family (a process of its own: asked once)
    refused = convert(
        "mcore-to-hf", "--load", tmp_path / "mc", "--hf-config", hf_dir, "--out", tmp_path / "hf2", check=False
    )
    assert refused.returncode == 2 and "--force" in refused.stderr


def test_truncated_and_misshaped_checkpoints_are_named(hf_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :-1].clone()
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    # refused by the launcher, before its two ranks start (the error comes once)
    proc = convert(
        "hf-to-mcore", "--hf-dir", bad, "--out", tmp_path / "o1", "--tensor-model-parallel-size", 2, check=False
    )
    assert proc.returncode == 2 and proc.stderr.count("model.layers.1.mlp.down_proj.weight has shape") == 1
    del weights["model.layers.0.self_attn.q_proj.bias"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    proc = convert("hf-to-mcore", "--hf-dir", bad, "--out", tmp_path / "o2", check=False)
    assert proc.returncode == 2 and "model.layers.0.self_attn.q_proj.bias" in proc.stderr
    data = (hf_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = convert("hf-to-mcore", "--hf-dir", bad, "--out", tmp_path / "o3", check=False)
    assert proc.returncode == 2 and "not a readable safetensors file" in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
    proc = convert(
        "mcore-to-hf", "--load", tmp_path / "nothing", "--hf-config", hf_dir, "--out", tmp_path / "o4", check=False
    )
    assert proc.returncode == 2 and "holds no complete checkpoint" in proc.stderr


def test_load_takes_a_save_directory_like_the_trainers_load(tmp_path, capsys):
    """--load takes what the trainer's --load takes: a --save directory converts the checkpoint its
    tracker names, or --ckpt-step N's; a missing step or a
    directory of damaged checkpoints is refused, before any rank starts, naming what is there. The conversion of a
    trainer's --save directory itself, generating with transformers: tests/test_resume.py
    (test_save_hf_loads_in_transformers_with_the_checkpoint_weights)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root = tmp_path / "run"
    for step in (2, 4):
        (root / f"iter_{step:07d}").mkdir(parents=True)
        (root / f"iter_{step:07d}" / "megatron_pacs.json").write_text(json.dumps({"step": step}))
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert tool.resolve_load(str(root), None) == root / "iter_0000002"
    assert tool.resolve_load(str(root), 4) == root / "iter_0000004"
    assert tool.resolve_load(str(root / "iter_0000004"), None) == root / "iter_0000004"
    args = ["mcore-to-hf", "--hf-config", str(tmp_path), "--out", str(tmp_path / "out")]
    assert tool.main([*args, "--load", str(root), "--ckpt-step", "7"]) == 2
    assert "--ckpt-step: " in capsys.readouterr().err
    for step in (2, 4):
        (root / f"iter_{step:07d}" / "megatron_pacs.json").write_text("")
    assert tool.main([*args, "--load", str(root)]) == 2
    err = capsys.readouterr().err
    assert "iter_0000002/megatron_pacs.json is empty" in err and "iter_0000004/megatron_pacs.json is empty" in err


def test_compare_logprobs_tool_at_tp2(hf_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "What is 2+3?", "answer": "5"}\n{"text": "12 * 7 = 84. The answer is 84."}\n')
    tool = TOOL.parent / "compare_logprobs.py"
    cmd = [sys.executable, str(tool), "--hf-dir", str(hf_dir), "--data", str(data), "--tensor-model-parallel-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    overall = [line for line in proc.stdout.splitlines() if line.startswith("overall max abs diff")]
    assert overall and float(overall[0].split()[-1]) < 1e-5, proc.stdout
    assert proc.stdout.count("|    ") >= 2  # one row per sequence
