"""Checkpoints through the real trainer (fleet, scorer, Megatron; fp32 on CPU).

4 steps straight == 2 steps + resume + 2 steps, bitwise; the same with PACS v2's reference resets (one right
before the checkpoint, one after the resume) and a KL term, and one step off policy (the checkpoint holds the
next step's rollouts, whose weights are gone); an interrupted checkpoint is ignored on resume; a run
saved at TP=2 resumes at TP=1; the ``--save-hf`` directory loads in transformers and holds exactly the
checkpoint's weights (checked against tools/convert_checkpoint.py mcore-to-hf).

The off-policy resume starts its own fleet (re-synced to the loaded weights: the fleet's side of a resume); the
others replay the continuous run's dumps (``--rollout-source replay``, no fleet), which gives the same steps bit for
bit at a fraction of a fleet's start.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import zygote
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS, make_rl_setup, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[1]


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=False, num_problems=32)


@pytest.fixture(scope="module")
def setup(launch_queue) -> Path:
    return launch_queue.root(__name__)


def _train(root, name, *extra, world=1, without_fleet_stack=False):
    flags = [
        "--hf-model",
        str(root / "model"),
        "--train-data",
        str(root / "train.jsonl"),
        *(TINY_TRAIN_FLAGS if without_fleet_stack else TINY_RUN_FLAGS),
        "--micro-batch-size",
        "8",
        *extra,
    ]
    return run_train(flags, log_dir=root / name, cwd=root, world=world, without_fleet_stack=without_fleet_stack)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _resume_chain(root):
    """The continuous run (checkpoints at steps 2 and 4), then a resume from a copy of its step-2 checkpoint beside
    a write killed half-way (a temporary folder) and a folder without metadata, which must both be ignored; the
    resume replays the continuous run's steps 3 and 4 from its dumps."""
    _train(root, "straight", "--train-iters", "4", "--save", str(root / "ckpt_a"), "--save-interval", "2", "--save-hf")
    shutil.copytree(root / "ckpt_a" / "iter_0000002", root / "ckpt_b" / "iter_0000002")
    (root / "ckpt_b" / "latest_checkpointed_iteration.txt").write_text("2\n")
    (root / "ckpt_b" / ".iter_0000003.tmp-crash").mkdir()
    (root / "ckpt_b" / "iter_0000003").mkdir()
    (root / "ckpt_b" / "iter_0000003" / "__0_0.distcp").write_bytes(b"partial")
    replay = ["--rollout-source", "replay", "--replay-from", str(root / "straight")]
    ckpt = str(root / "ckpt_b")
    flags = ["--train-iters", "4", "--save", ckpt, "--load", ckpt, "--save-hf", *replay]
    return _train(root, "split", *flags, without_fleet_stack=True)


def test_resume_equals_continuous_and_ignores_interrupted_writes(setup, launched):
    root = setup
    history = launched["resume"].result()
    assert [m["step"] for m in history] == [3, 4]
    a = _weights(root / "ckpt_a" / "iter_0000004" / "hf")
    b = _weights(root / "ckpt_b" / "iter_0000004" / "hf")
    initial = _weights(root / "model")
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-4  # training moved the weights
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert not (root / "ckpt_b" / ".iter_0000003.tmp-crash").exists()  # cleaned by the next save


V2 = ["--pacs-score-reference", "ref", "--ref-reset-interval", "2", "--kl-coef", "0.05"]


def _resets_chain(root):
    """The continuous run with resets at steps 2 and 4 (checkpoints at 2 and 4), then a resume from its step-2
    checkpoint that replays its steps 3 and 4 from its dumps (no fleet: Ray, vLLM and math-verify absent; the fleet's
    side of a resume, re-synced to the loaded weights, is the off-policy resume's)."""
    straight = _train(
        root,
        "v2_straight",
        "--train-iters",
        "4",
        "--save",
        str(root / "ckpt_v2a"),
        "--save-interval",
        "2",
        "--save-hf",
        *V2,
    )
    mid = root / "ckpt_v2a" / "iter_0000002"
    meta = json.loads((mid / "megatron_pacs.json").read_text())
    replay = ["--rollout-source", "replay", "--replay-from", str(root / "v2_straight")]
    flags = ["--train-iters", "4", "--load", str(mid), "--save", str(root / "ckpt_v2r"), "--save-hf", *V2, *replay]
    return straight, meta, _train(root, "v2_replay", *flags, without_fleet_stack=True)


def test_a_resume_with_reference_resets_equals_the_continuous_run(setup, launched):
    """Resets at steps 2 and 4 (reference <- policy, Adam moments zeroed); the checkpoint at step 2 is written right
    after the first, so it holds the reset reference and the reset optimizer. Resumed there and replaying the
    continuous run's dumps, steps 3 and 4 (the second reset) give the run's rewards, losses, gradient
    norms, KL and final weights bit for bit."""
    root = setup
    straight, meta, replayed = launched["resets"].result()
    # written right after the reset: the reference equals the actor, so the resumed step 3 takes s = 0 exactly too
    assert meta["reference"] == {"resets": 1, "equals_actor": True}
    assert (root / "ckpt_v2a" / "iter_0000002" / "reference").is_dir()
    assert [m["ref/resets"] for m in replayed] == [1.0, 2.0]
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "ref/kl", "ref/resets", "pacs/loss")
    assert [m["step"] for m in replayed] == [3, 4]
    assert [{k: m[k] for k in keys} for m in replayed] == [{k: m[k] for k in keys} for m in straight[-2:]]
    a = _weights(root / "ckpt_v2a" / "iter_0000004" / "hf")
    b = _weights(root / "ckpt_v2r" / "iter_0000004" / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _in_flight_chain(root):
    off = ["--off-policy-steps", "1"]
    straight = _train(
        root,
        "off_straight",
        "--train-iters",
        "4",
        "--save",
        str(root / "ckpt_offa"),
        "--save-interval",
        "2",
        "--keep-last",
        "2",
        "--save-hf",
        *off,
    )
    mid = root / "ckpt_offa" / "iter_0000002"
    meta = json.loads((mid / "megatron_pacs.json").read_text())
    pending = (mid / "pending_rollouts.pt").is_file()
    resumed = _train(
        root,
        "off_resumed",
        "--train-iters",
        "4",
        "--load",
        str(mid),
        "--save",
        str(root / "ckpt_offb"),
        "--save-hf",
        *off,
    )
    return straight, meta, pending, resumed


def test_resume_with_a_generation_in_flight_equals_continuous(setup, launched):
    """--off-policy-steps 1: at the step-2 checkpoint the rollouts of step 3 (generated on step 1's weights) are done
    and saved; a run resumed from it trains on them, then generates step 4's on step 2's weights, bit for bit."""
    root = setup
    straight, meta, pending, resumed = launched["in_flight"].result()
    assert meta["pending_step"] == 3
    assert pending
    assert [m["step"] for m in resumed] == [3, 4]
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/policy_lag")
    assert [{k: m[k] for k in keys} for m in straight[-2:]] == [{k: m[k] for k in keys} for m in resumed]
    a = _weights(root / "ckpt_offa" / "iter_0000004" / "hf")
    b = _weights(root / "ckpt_offb" / "iter_0000004" / "hf")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def test_save_hf_loads_in_transformers_with_the_checkpoint_weights(setup, launched):
    from transformers import AutoModelForCausalLM

    root = setup
    launched["resume"].result()  # wrote ckpt_a
    ckpt = root / "ckpt_a" / "iter_0000004"
    out = root / "converted"
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "convert_checkpoint.py"),
        "mcore-to-hf",
        "--load",
        str(root / "ckpt_a"),  # the --save directory: the checkpoint its tracker names, as the trainer resumes (29.8)
        "--hf-config",
        str(root / "model"),
        "--out",
        str(out),
    ]
    proc = zygote.run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"(from {ckpt})" in proc.stdout
    saved, converted = _weights(ckpt / "hf"), _weights(out)
    assert set(saved) == set(converted)
    assert all(torch.equal(saved[k], converted[k]) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt / "hf"), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 30, 60, 7]])
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(model(ids).logits, ref(ids).logits)
    assert torch.equal(
        ref.generate(ids, max_new_tokens=6, do_sample=False), model.generate(ids, max_new_tokens=6, do_sample=False)
    )


def _tp2_chain(root):
    """3 steps at TP=2 (two ranks, the fleet synced from both shards), saved at step 2; then a resume of that
    checkpoint at TP=1 (one rank), replaying step 3's rollouts from the TP=2 run's dumps."""
    tp2 = _train(
        root,
        "tp2",
        "--train-iters",
        "3",
        "--save",
        str(root / "ckpt_tp2"),
        "--save-interval",
        "2",
        "--tensor-model-parallel-size",
        "2",
        world=2,
    )
    replay = ["--rollout-source", "replay", "--replay-from", str(root / "tp2")]
    ckpt = root / "ckpt_tp1"
    flags = ["--train-iters", "3", "--load", str(root / "ckpt_tp2" / "iter_0000002"), "--save", str(ckpt), *replay]
    return tp2, _train(root, "tp1", *flags, without_fleet_stack=True)


def test_checkpoint_saved_at_tp2_resumes_at_tp1(setup, launched):
    """The resumed step 3 equals the TP=2 run's to fp32 rounding (the same arithmetic, split across two ranks'
    GEMMs: the loss equal, the gradient norm 2.5e-7 relative apart, measured)."""
    root = setup
    tp2, tp1 = launched["tp2"].result()
    assert [m["step"] for m in tp1] == [3] and tp1[-1]["train/skipped_steps"] == 0.0
    assert tp1[-1]["rollout/reward_mean"] == tp2[-1]["rollout/reward_mean"]
    for key in ("train/loss", "train/grad_norm"):
        assert tp1[-1][key] == pytest.approx(tp2[-1][key], rel=1e-5), key
    meta = json.loads((root / "ckpt_tp1" / "iter_0000003" / "megatron_pacs.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["loader"]["position"] == 12


LAUNCHES = {"resume": _resume_chain, "resets": _resets_chain, "in_flight": _in_flight_chain, "tp2": _tp2_chain}
