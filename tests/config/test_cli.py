"""Flags and configuration: every flag documented, bad flags and data refused before anything is built."""

import subprocess
import sys

import pytest

from megatron_pacs.config import build_parser, parse_config


def test_help_documents_every_flag():
    parser = build_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 50
    assert all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    flags = {s for a in actions for s in a.option_strings}
    for megatron_flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                          "--global-batch-size", "--lr", "--seq-length", "--bf16", "--fp8-format",
                          "--use-distributed-optimizer", "--recompute-activations"):  # fmt: skip
        assert megatron_flag in flags


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--group-size", "1"], "--group-size"),
        (["--global-batch-size", "10", "--ppo-mini-batch-size", "4"], "--ppo-mini-batch-size"),
        (["--loss", "ppo"], "--loss"),
        (["--pacs-advantage", "mean"], "--pacs-advantage"),
        (["--fp8-format", "e4m3"], "--fp8-format"),
        (["--sequence-parallel"], "--sequence-parallel"),
        (["--max-tokens-per-microbatch", "100"], "--max-tokens-per-microbatch"),
        (["--keep-groups-in-microbatch", "--micro-batch-size", "6"], "--micro-batch-size"),
        (["--val-n", "4"], "--val-n"),
        (["--temperature", "0"], "--temperature"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_validate_checks_layout_and_files(tmp_path):
    cfg = parse_config(["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--ppo-mini-batch-size", "4"])
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        cfg.validate(3, need_files=False)
    with pytest.raises(ValueError, match="--ppo-mini-batch-size"):
        cfg.validate(16, need_files=False)  # DP = 8 does not divide 4 prompts
    assert cfg.validate(8, need_files=False) == 4
    with pytest.raises(ValueError, match="--hf-model"):
        cfg.validate(2)
    (tmp_path / "config.json").write_text("{}")
    cfg = parse_config(["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "nope.jsonl")])
    with pytest.raises(ValueError, match=r"--train-data: .*nope.jsonl does not exist"):
        cfg.validate(1)
    cfg = parse_config(["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "config.json"),
                        "--eval-interval", "5"])  # fmt: skip
    with pytest.raises(ValueError, match="--eval-interval"):
        cfg.validate(1)


def test_train_refuses_bad_data_before_building_anything(tmp_path):
    """The entry point exits 2 with the fix in the message, in about a second (no Megatron, Ray or vLLM)."""
    (tmp_path / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "megatron_pacs.train", "--hf-model", str(tmp_path), "--train-data", "missing.jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--train-data" in proc.stderr and "tools/prepare_data.py" in proc.stderr
