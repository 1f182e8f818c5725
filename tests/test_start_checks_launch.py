"""A real checkpoint records its model's shape, and the start-of-run checks read it: one step of the tiny
run without the fleet (``--rollout-source synthetic``) saves a checkpoint; resuming it with a model of another shape
is refused before anything is built, naming ``--load`` and the fields (it failed only after Ray and the engines had
started, with raw tracebacks), and resuming it at its own step ends at once with ``nothing to train`` (exit 0)."""

from dataclasses import asdict
from pathlib import Path

import pytest
from helpers.runs import TINY_TRAIN_FLAGS, make_rl_setup, run_train
from helpers.tiny_folders import make_model

from megatron_pacs.planner import ModelShape
from megatron_pacs.utils.checkpoint_dirs import read_metadata

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=True, num_problems=8)


def _one_step(root: Path) -> Path:
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS]
    run_train([*flags, *SYNTHETIC, "--train-iters", "1", "--save", str(root / "ckpt")], log_dir=root / "run", cwd=root)
    return root / "ckpt"


LAUNCHES = {"saved": _one_step}  # queued for the session (tests/launch_queue.py)


@pytest.fixture(scope="module")
def setup(launch_queue) -> Path:
    return launch_queue.root(__name__)


def test_a_saved_checkpoint_of_another_shape_is_refused_and_one_at_its_end_trains_nothing(
    setup, launched, tmp_path, capsys
):
    from megatron_pacs.train import main

    ckpt = launched["saved"].result()
    meta = read_metadata(ckpt / "iter_0000001")
    assert meta["model_shape"] == asdict(ModelShape.from_pretrained(setup / "model"))
    other = make_model(tmp_path / "other", layers=3, hidden=128)  # 2 layers of 128 in the checkpoint
    argv = ["--train-data", str(setup / "train.jsonl"), *TINY_TRAIN_FLAGS, *SYNTHETIC, "--load", str(ckpt)]
    argv += ["--log-dir", str(tmp_path / "resumed")]
    with pytest.raises(ValueError, match=rf"--load {ckpt}: .* num_hidden_layers 2 there, 3 here"):
        main(["--hf-model", str(other), *argv, "--train-iters", "2"])
    assert main(["--hf-model", str(setup / "model"), *argv, "--train-iters", "1"]) == 0
    assert "nothing to train: the checkpoint is at step 1 and --train-iters is 1" in capsys.readouterr().out
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()
