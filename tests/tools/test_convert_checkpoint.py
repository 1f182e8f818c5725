"""tools/convert_checkpoint.py end to end: HF -> Megatron (TP=2; a Qwen3-MoE at TP=2 x EP=2) -> HF bitwise, and
clear errors; tools/compare_logprobs.py at TP=2.

The tools' runs that start ranks (processes of their own, mostly start-up) are launches of the session's queue
(tests/launch_queue.py): they run two at a time beside the other modules' tests, and the tests here check what they
left. The refusals, which come before any rank starts, call the tool's ``main`` in this process."""

import json
import sys
from functools import partial
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
from launch_queue import run_launch
from safetensors.torch import load_file, save_file

from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

pytestmark = pytest.mark.slow

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"


def convert(*args) -> CompletedProcess[str]:
    return run_launch([sys.executable, str(TOOL), *map(str, args)], timeout=600)


def _tiny(path: Path, family: str) -> Path:
    config = tiny_hf_config(family, tied=False, layers=2)
    build_tiny_model(str(path), config, seed=3, scale=2.0, tokenizer=build_tokenizer(vocab_size=400))
    return path


#: (TP, EP) there and back. qwen2 at TP=2, back at TP=1 (resharded); a Qwen3-MoE (qk-norm weights and untied like
#: Qwen3-8B; 8 experts) loaded at TP=2 x EP=2 on 4 ranks, where a TP group's ranks hold different experts (mbridge's
#: read on TP rank 0 and scatter gave TP rank 1 rank 0's experts), back at TP=1 x EP=1 (resharded). Dense Qwen3's
#: export at TP=2: tests/mcore/test_distributed.py; the MoE export at TP=2 and at EP=2: tests/mcore/test_moe.py.
LAYOUTS = {"qwen2": ((2, 1), (1, 1)), "qwen3_moe": ((2, 2), (1, 1))}


def _hf_dir(root: Path, family: str) -> Path:
    return root / ("hf" if family == "qwen2" else f"hf_{family}")


def prepare(root: Path) -> Path:
    """The tiny HF models, one per family (the qwen2 one, ``root/hf``, for compare_logprobs.py too)."""
    for family in LAYOUTS:
        _tiny(_hf_dir(root, family), family)
    return root


def _round_trip(root: Path, family: str) -> dict[str, CompletedProcess[str]]:
    """hf-to-mcore, then mcore-to-hf if it succeeded: the runs by name."""
    hf_dir, work = _hf_dir(root, family), root / family
    (tp, ep), (back_tp, back_ep) = LAYOUTS[family]
    layout = ["--tensor-model-parallel-size", tp, "--expert-model-parallel-size", ep]
    runs = {"there": convert("hf-to-mcore", "--hf-dir", hf_dir, "--out", work / "mc", *layout)}
    if runs["there"].returncode != 0:
        return runs
    back = ["--tensor-model-parallel-size", back_tp, "--expert-model-parallel-size", back_ep]
    runs["back"] = convert("mcore-to-hf", "--load", work / "mc", "--hf-config", hf_dir, "--out", work / "hf2", *back)
    return runs


def _compare_logprobs(root: Path) -> CompletedProcess[str]:
    data = root / "rows.jsonl"
    data.write_text('{"problem": "What is 2+3?", "answer": "5"}\n{"text": "12 * 7 = 84. The answer is 84."}\n')
    tool = TOOL.parent / "compare_logprobs.py"
    cmd = [sys.executable, str(tool), "--hf-dir", str(root / "hf"), "--data", str(data)]
    return run_launch([*cmd, "--tensor-model-parallel-size", "2"], timeout=600)


#: queued for the session (tests/launch_queue.py)
LAUNCHES = {
    **{family: partial(_round_trip, family=family) for family in LAYOUTS},
    "compare_logprobs": _compare_logprobs,
}


@pytest.fixture(scope="module")
def root(launch_queue) -> Path:
    return launch_queue.root(__name__)


def _ok(proc: CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_round_trip_is_bitwise(family, launched, root, capfd):
    runs = launched[family].result()
    hf_dir, work = _hf_dir(root, family), root / family
    _ok(runs["there"])
    assert (work / "mc" / "megatron_pacs.json").is_file()
    _ok(runs["back"])
    a, b = load_file(hf_dir / "model.safetensors"), load_file(work / "hf2" / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (work / "hf2" / side).is_file(), side
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(work / "hf2")
    AutoTokenizer.from_pretrained(work / "hf2")
    if family != "qwen2":
        return  # the refusal below is the same for every family (asked once)
    again = ["--load", str(work / "mc"), "--hf-config", str(hf_dir), "--out", str(work / "hf2")]
    assert _tool().main(["mcore-to-hf", *again]) == 2  # the launcher refuses it: in this process
    assert "--force" in capfd.readouterr().err


def _tool():
    """tools/convert_checkpoint.py as a module, to call its ``main`` in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_truncated_and_misshaped_checkpoints_are_named(tmp_path, capfd):
    """Refused by the launcher before any rank starts (in this process: ``main`` returns before its ranks would be
    started; capfd would show their errors too), each naming the tensor, the file or the folder."""
    tool, hf_dir = _tool(), _tiny(tmp_path / "hf", "qwen2")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :-1].clone()
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    # refused by the launcher, before its two ranks start (the error comes once)
    code = tool.main(
        ["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o1"), "--tensor-model-parallel-size", "2"]
    )
    assert code == 2 and capfd.readouterr().err.count("model.layers.1.mlp.down_proj.weight has shape") == 1
    del weights["model.layers.0.self_attn.q_proj.bias"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    code = tool.main(["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o2")])
    assert code == 2 and "model.layers.0.self_attn.q_proj.bias" in capfd.readouterr().err
    data = (hf_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    code = tool.main(["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o3")])
    assert code == 2 and "not a readable safetensors file" in capfd.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
    args = ["--load", str(tmp_path / "nothing"), "--hf-config", str(hf_dir), "--out", str(tmp_path / "o4")]
    assert tool.main(["mcore-to-hf", *args]) == 2
    assert "holds no complete checkpoint" in capfd.readouterr().err


def test_load_takes_a_save_directory_like_the_trainers_load(tmp_path, capsys):
    """--load takes what the trainer's --load takes: a --save directory converts the checkpoint its
    tracker names, or --ckpt-step N's; a missing step or a
    directory of damaged checkpoints is refused, before any rank starts, naming what is there. The conversion of a
    trainer's --save directory itself, generating with transformers: tests/test_resume.py
    (test_save_hf_loads_in_transformers_with_the_checkpoint_weights)."""
    tool = _tool()
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


def test_compare_logprobs_tool_at_tp2(launched):
    proc = launched["compare_logprobs"].result()
    _ok(proc)
    overall = [line for line in proc.stdout.splitlines() if line.startswith("overall max abs diff")]
    assert overall and float(overall[0].split()[-1]) < 1e-5, proc.stdout
    assert proc.stdout.count("|    ") >= 2  # one row per sequence
