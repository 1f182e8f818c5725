"""Checkpoint content proven on a real training run: the tiny model trained 3 steps on synthetic
rollouts with a checkpoint every step and a reference reset at step 2. Consecutive checkpoints record different
values for every trained tensor, each records the live weights of its step (the --save-hf export of that step), and
the reference saved after its reset records the actor's weights of that step."""

from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_TRAIN_FLAGS, make_rl_setup, run_train
from safetensors.torch import load_file

from megatron_pacs.mcore.checkpoint_fingerprint import read_fingerprints

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=False, num_problems=16)


def _three_steps(root: Path) -> Path:
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS]
    flags += ["--kl-coef", "0.05", "--ref-reset-interval", "2", "--save-hf", "--keep-last", "3"]
    flags += ["--train-iters", "3", "--save-interval", "1", "--save", str(root / "ckpt")]
    run_train([*flags, *SYNTHETIC], log_dir=root / "run", cwd=root)
    return root / "ckpt"


LAUNCHES = {"saved": _three_steps}  # queued for the session (tests/launch_queue.py)


def _sums(t: torch.Tensor) -> list[float]:
    t = t.double()
    return [t.numel(), t.sum().item(), (t * t).sum().item()]


def test_each_checkpoint_records_its_steps_weights(launched):
    ckpt = launched["saved"].result()
    recorded = {s: read_fingerprints(ckpt / f"iter_{s:07d}")[0] for s in (1, 2, 3)}
    trained = [k for k in recorded[1] if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert trained and any(k.startswith("optimizer.") for k in recorded[1]), sorted(recorded[1])
    for earlier, later in ((1, 2), (2, 3)):
        same = [k for k in recorded[1] if recorded[earlier][k] == recorded[later][k] and "step" not in k]
        assert not [k for k in same if k in trained], (earlier, later, same)
    for s in (1, 2, 3):  # the live weights of step s, as --save-hf exported them after the save
        hf = load_file(ckpt / f"iter_{s:07d}" / "hf" / "model.safetensors")
        for ours, theirs in (
            ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
            ("decoder.final_layernorm.weight", "model.norm.weight"),
        ):
            assert recorded[s][ours] == pytest.approx(_sums(hf[theirs].float()), rel=1e-6), (s, ours)
    reference, _ = read_fingerprints(ckpt / "iter_0000002" / "reference")
    assert {k: reference[k] for k in trained} == {k: recorded[2][k] for k in trained}
