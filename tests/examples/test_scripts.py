"""The launch scripts under examples/: bash syntax, shared flags in both branches, and a real ``DRY_RUN=1`` run.

The dry runs execute ``python -m megatron_pacs.train --dry-run`` and so need the trainer: without
``megatron_pacs/train.py`` they fail (never skip), which is the point of testing the scripts.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ALL_SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))
# The Qwen recipes; tiny_cluster.sh runs for real in tests/cluster/, lib/ holds helpers, not recipes.
MULTI_NODE = [p for p in ALL_SCRIPTS if p.name not in ("tiny_cpu.sh", "tiny_cluster.sh") and p.parent.name != "lib"]


def _trainer_flags() -> set[str]:
    """The trainer's flags (megatron_pacs.train's parser); a script using any other spelling is a bug."""
    from megatron_pacs.config.cli import build_parser

    return {option for action in build_parser()._actions for option in action.option_strings}


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(EXAMPLES)) for p in paths]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A dry-run environment: an absent HF_MODEL (so the shipped config.json is used) and tmp outputs and data."""
    row = '{"problem": "What is 1 + 1?", "answer": "2"}\n'
    (tmp_path / "train.jsonl").write_text(row)
    (tmp_path / "val.jsonl").write_text(row)
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "WANDB_PROJECT")}
    env.update(
        HF_MODEL=str(tmp_path / "no-such-model"),
        TRAIN_DATA=str(tmp_path / "train.jsonl"),
        VAL_DATA=f"{tmp_path / 'val.jsonl'} {tmp_path / 'val.jsonl'}",
        SAVE_DIR=str(tmp_path / "ckpt"),
        LOG_DIR=str(tmp_path / "logs"),
        PYTHON=sys.executable,
    )
    env.update(extra)
    return env


def test_there_are_scripts():
    assert len(MULTI_NODE) >= 4 and (EXAMPLES / "tiny_cpu.sh").is_file()


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=_ids(ALL_SCRIPTS))
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True, text=True)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "pkill" not in text


@pytest.mark.parametrize("script", MULTI_NODE, ids=_ids(MULTI_NODE))
def test_both_branches_pass_the_same_trainer_flags(script, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fakepython"  # print argv, one per line
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = _env(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "fakepython"), NNODES="2")

    def argv(dry: str) -> list[str]:
        out = subprocess.run(["bash", str(script)], env={**env, "DRY_RUN": dry}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    launcher, dry = argv("0"), argv("1")
    assert launcher[:2] == ["-m", "megatron_pacs.torchrun"]  # torchrun's flags; exits 0 after a clean preemption
    real = launcher[2:]
    assert real[:10] == shlex.split(
        "--nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr localhost --master-port 6000"
    )
    assert real[10:12] == dry[:2] == ["-m", "megatron_pacs.train"]
    assert dry[-3:] == ["--dry-run", "--world-size", "16"]
    assert real[12:] == [a if a != str(script.parent) else env["HF_MODEL"] for a in dry[2:-3]]
    flags = {a for a in real if a.startswith("--")} - {"--nnodes", "--node-rank", "--nproc-per-node"}
    assert flags - {"--master-addr", "--master-port"} <= _trainer_flags()
    for flag in ("--global-batch-size", "--group-size", "--ppo-mini-batch-size", "--train-iters", "--eval-interval"):
        assert flag in real


@pytest.mark.parametrize("script", MULTI_NODE, ids=_ids(MULTI_NODE))
def test_dry_run(script, tmp_path):
    assert (ROOT / "megatron_pacs" / "train.py").is_file(), "megatron_pacs/train.py does not exist yet"
    out = subprocess.run(
        ["bash", str(script)], env=_env(tmp_path, DRY_RUN="1"), capture_output=True, text=True, timeout=600
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "64" in text and "memory" in text.lower(), text[-4000:]
    if script.parent.name == "qwen3-30b-a3b":
        # The MoE recipes plan expert parallelism (EP 8) with the all-to-all dispatcher: this needs the RL loop to
        # accept --expert-model-parallel-size > 1 (TrainConfig.validate refused it before the lockstep work).
        assert "EP 8 (16 of 128 experts per rank)" in text and "sequence parallel on" in text, text[-4000:]


def _trainer_args(script: str, tmp_path) -> list[str]:
    """The trainer arguments ``script`` passes under ``DRY_RUN=1`` (a fake python that prints them one a line)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "fakepython").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_dir / "fakepython").chmod(0o755)
    env = _env(tmp_path, PYTHON=str(bin_dir / "fakepython"), DRY_RUN="1")
    out = subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _last(args: list[str], flag: str) -> str:
    """The value of ``flag``'s last occurrence (argparse keeps the last)."""
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


@pytest.mark.parametrize(("script", "steps"), [("qwen3-4b/pacs_v2.sh", 120), ("qwen3-8b/pacs_v2.sh", 320)])
def test_pacs_v2_recipes_follow_the_papers_appendix_c(script, steps, tmp_path):
    """1,024 prompts x 8, mini-batch 256, responses up to 8,192 tokens, lr 1e-6, beta 1, no KL, the score anchored
    at the reference with an optimizer-resetting reset, and the step count of the paper."""
    args = _trainer_args(script, tmp_path)

    def last(flag: str) -> str:
        return _last(args, flag)

    expected = {
        "--global-batch-size": "1024",
        "--group-size": "8",
        "--ppo-mini-batch-size": "256",
        "--max-response-length": "8192",
        "--lr": "1e-6",
        "--pacs-beta": "1.0",
        "--kl-coef": "0.0",
        "--pacs-score-reference": "ref",
        "--train-iters": str(steps),
        "--ref-reset-interval": "20",
    }
    assert {flag: last(flag) for flag in expected} == expected
    assert "--ref-reset-optimizer" in args


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "qwen2.5-7b/dapo.sh",  # DAPO (arXiv 2503.14476) as verl's recipe/dapo 7B script sets it
            {
                "--loss": "grpo",
                "--clip-ratio-low": "0.2",
                "--clip-ratio-high": "0.28",
                "--clip-ratio-c": "10.0",
                "--loss-agg-mode": "token-mean",
                "--filter-groups": "zero-variance",
                "--overlong-buffer-len": "4096",
                "--overlong-penalty-factor": "1.0",
                "--max-response-length": "8192",
                "--group-size": "16",
                "--global-batch-size": "512",
                "--ppo-mini-batch-size": "32",
                "--kl-coef": "0.0",
            },
        ),
        (
            "qwen3-30b-a3b/gspo.sh",  # GSPO (arXiv 2507.18071): sequence-level clip 3e-4 / 4e-4, four mini-batches
            {
                "--loss": "gspo",
                "--clip-ratio-low": "3e-4",
                "--clip-ratio-high": "4e-4",
                "--loss-agg-mode": "seq-mean-token-mean",
                "--kl-coef": "0.0",
                "--global-batch-size": "1024",
                "--ppo-mini-batch-size": "256",
            },
        ),
    ],
)
def test_field_recipes_carry_the_published_settings(script, expected, tmp_path):
    args = _trainer_args(script, tmp_path)

    def last(flag: str) -> str:
        return _last(args, flag)

    assert {flag: last(flag) for flag in expected} == expected


@pytest.mark.parametrize("script", ["qwen3-4b/grpo.sh", "qwen3-4b/ppo.sh", "qwen3-8b/grpo.sh", "qwen3-8b/ppo.sh"])
def test_v2_baselines_share_pacs_v2s_data_batches_lengths_and_schedule(script, tmp_path):
    """PACS v2's GRPO and PPO rows (Appendix C: the same learning rates, the KL loss off): every flag the PACS v2
    recipe of the same model sets for the batch, the lengths and the schedule is the baseline's too; only the
    objective differs (and PPO's critic at 1e-5)."""

    def flags(name: str) -> dict[str, str]:
        args = _trainer_args(name, tmp_path)
        return {a: _last(args, a) for a in args[:-1] if a.startswith("--")}

    ours, v2 = flags(script), flags(f"{script.split('/')[0]}/pacs_v2.sh")
    shared = ("--global-batch-size", "--group-size", "--ppo-mini-batch-size", "--max-prompt-length")
    shared += ("--max-response-length", "--lr", "--train-iters", "--kl-coef", "--tensor-model-parallel-size")
    assert {f: ours[f] for f in shared} == {f: v2[f] for f in shared}
    loss = script.split("/")[1].removesuffix(".sh")
    assert ours["--loss"] == loss and ours["--kl-coef"] == "0.0"
    assert (ours.get("--critic-lr") == "1e-5") == (loss == "ppo")


RECIPES = [*MULTI_NODE, EXAMPLES / "tiny_cluster.sh"]


@pytest.mark.parametrize("script", RECIPES, ids=_ids(RECIPES))
def test_a_recipe_puts_the_checkout_on_pythonpath(script, tmp_path):
    """The checkout first on ``PYTHONPATH`` (megatron_pacs without an installed copy), whatever folder the recipe
    lives in: tiny_cluster.sh, one level up from the model folders, once put the checkout's parent there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fakepython"
    fake.write_text('#!/bin/sh\necho "$PYTHONPATH"\n')
    fake.chmod(0o755)
    env = _env(tmp_path, PYTHON=str(fake), NNODES="2", PYTHONPATH="/elsewhere")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{ROOT}:/elsewhere"
