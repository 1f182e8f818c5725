"""PPO through the real CLI (``--loss ppo``, synthetic rollouts, a tied tiny Qwen2; fp32 on CPU): one launch of 4 steps
with a critic warm-up step and ``--async-save`` checkpoints at steps 2 and 4, one launch resumed from the step-2
checkpoint under ``--deterministic-mode``, and three resumed from it at other layouts (two pipeline stages; two
data-parallel ranks; two tensor-parallel ranks with sequence parallelism).

It guards: step 1 (``--critic-warmup 1``) trains the critic only (no actor optimizer step, no weight sync), later
steps train both; the critic's metrics and timings are logged and the critic learns (its values leave 0, its loss
falls); the checkpoint holds the critic's weights and Adam state with fingerprints; the resumed steps 3 and 4 equal
the continuous run's bit for bit, and so do the critic's saved weights and optimizer state; at PP=2 (the tied
embeddings untied in the critic: verl PR #6105's hang) the checkpoint loads and the steps agree to float rounding;
at DP=2 too, which they do only if GAE's whitening takes the step's mean and variance over both ranks' responses;
and at TP=2 with sequence parallelism, where each rank's value head sees half the sequence (its gradient summed over
TP) and is counted once in the gradient norm.
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers.runs import TINY_TRAIN_FLAGS, make_rl_setup, run_train

from megatron_pacs.mcore.checkpoint_fingerprint import read_fingerprints

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "4"]
PPO = ["--loss", "ppo", "--critic-warmup", "1", "--critic-lr", "1e-3", "--gae-lambda", "0.95", "--deterministic-mode"]


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=True, num_problems=16)


def _train(root: Path, name: str, *extra: str, world: int = 1) -> list[dict]:
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_TRAIN_FLAGS]
    flags += [*SYNTHETIC, *PPO, "--train-iters", "4", *extra]
    return run_train(flags, log_dir=root / name, cwd=root, world=world)


def _resume(root: Path, mid: Path, name: str, *extra: str, world: int = 1) -> list[dict]:
    ckpt = root / f"ckpt_{name}"
    shutil.copytree(mid, ckpt / mid.name)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    return _train(root, name, "--save", str(ckpt), "--load", str(ckpt), *extra, world=world)


def _continuous_and_resumed(root: Path) -> tuple[list[dict], list[dict], list[dict], dict]:
    straight = _train(root, "straight", "--save", str(root / "ckpt_a"), "--save-interval", "2", "--async-save")
    mid = root / "ckpt_a" / "iter_0000002"
    meta = json.loads((mid / "megatron_pacs.json").read_text())
    resumed = _resume(root, mid, "b")
    others = {"pp2": _resume(root, mid, "pp2", "--pipeline-model-parallel-size", "2", world=2)}
    others["dp2"] = _resume(root, mid, "dp2", world=2)
    others["tp2"] = _resume(root, mid, "tp2", "--tensor-model-parallel-size", "2", "--sequence-parallel", world=2)
    return straight, resumed, others, meta


def _reward_kl(root: Path) -> list[dict]:
    # and the token-level objectives' actor settings (issue 52), which the critic's phase never reads
    field = ["--loss-agg-mode", "token-mean", "--clip-ratio-high", "0.28", "--entropy-coef", "0.001"]
    return _train(root, "reward_kl", "--reward-kl-coef", "0.5", "--train-iters", "3", *field)


LAUNCHES = {"ppo": _continuous_and_resumed, "reward_kl": _reward_kl}  # queued for the session (tests/launch_queue.py)


def test_the_warm_up_trains_the_critic_alone_then_both_learn(launched):
    straight, *_ = launched["ppo"].result()
    assert [m["step"] for m in straight] == [1, 2, 3, 4]
    first, *rest = straight
    assert "train/optimizer_steps" not in first and "perf/time/sync" not in first  # the actor and engines wait
    assert first["critic/values/mean"] == 0.0  # a fresh head's values are exactly 0
    for m in rest:
        assert m["train/optimizer_steps"] == 2.0 and "perf/time/sync" in m
    for m in straight:
        for key in ("vf_loss", "vf_clipfrac", "vf_explained_var", "vpred_mean", "grad_norm", "lr", "returns/mean"):
            assert f"critic/{key}" in m, (m["step"], key)
        assert m["critic/lr"] == 1e-3 and m["critic/skipped_steps"] == 0.0
        assert m["perf/time/critic_values"] > 0 and m["perf/time/critic_update"] > 0
    assert abs(straight[-1]["critic/values/mean"]) > 0.05  # the critic has learned the returns' level
    assert straight[-1]["critic/vf_loss"] < straight[0]["critic/vf_loss"]


def test_a_resume_holds_the_critic_and_equals_the_continuous_run(launched, launch_queue):
    straight, resumed, _, meta = launched["ppo"].result()
    root = launch_queue.root(__name__)
    assert meta["critic"]["lr_schedule"]["num_steps"] == 4  # 2 steps x 2 mini-batches
    assert [m["step"] for m in resumed] == [3, 4]
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "critic/vf_loss", "critic/grad_norm")
    keys += ("critic/values/mean", "critic/advantages/mean", "critic/vf_explained_var")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in straight[2:]]
    saved = [read_fingerprints(root / ckpt / "iter_0000004" / "critic") for ckpt in ("ckpt_a", "ckpt_b")]
    assert saved[0] is not None and saved[1] is not None
    sums = saved[0][0]
    assert "output_layer.weight" in sums and "optimizer.state.exp_avg.output_layer.weight" in sums
    assert sums == saved[1][0]  # the critic's weights and Adam moments, bit for bit
    before = read_fingerprints(root / "ckpt_a" / "iter_0000002" / "critic")
    assert before is not None and before[0]["output_layer.weight"] != sums["output_layer.weight"]


@pytest.mark.parametrize("layout", ["pp2", "dp2", "tp2"])
def test_the_checkpoint_resumes_at_another_layout(launched, layout):
    straight, _, others, _ = launched["ppo"].result()
    other = others[layout]
    assert [m["step"] for m in other] == [3, 4]
    keys = ("train/loss", "train/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/values/mean")
    keys += ("critic/vf_explained_var", "ppo/advantage/mean")
    for got, want in zip(other, straight[2:], strict=True):
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"]
        assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-5, abs=1e-7)


def test_the_critic_exports_as_a_token_classification_model_with_the_trainers_values(launched, launch_queue):
    """tools/convert_checkpoint.py mcore-to-hf --critic writes a one-label token-classification model that
    transformers loads with no key missing; its values over step 3's rollouts, read at the position before each
    response token, average to the critic/values/mean that step logged from the same (step-2) weights."""
    import sys

    import torch
    import zygote
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    straight, *_ = launched["ppo"].result()
    root = launch_queue.root(__name__)
    out = root / "critic_hf"
    tool = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
    cmd = [sys.executable, str(tool), "mcore-to-hf", "--critic", "--load", str(root / "ckpt_a" / "iter_0000002")]
    proc = zygote.run([*cmd, "--hf-config", str(root / "model"), "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    model, info = AutoModelForTokenClassification.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.config.num_labels == 1
    dump = load_file(root / "straight" / "rollouts" / "step_000003.safetensors")
    values = []
    for i in range(len(dump["prompt_lens"])):
        ids = dump["token_ids"][dump["offsets"][i] : dump["offsets"][i + 1]].long()
        prompt, response = int(dump["prompt_lens"][i]), int(dump["response_lens"][i])
        with torch.no_grad():
            values.append(model(input_ids=ids[None]).logits[0, prompt - 1 : prompt + response - 1, 0])
    mean = torch.cat(values).double().mean().item()
    assert mean == pytest.approx(straight[2]["critic/values/mean"], rel=1e-5)


def test_the_reward_kl_enters_the_returns_once_the_actor_moves(launched):
    """--reward-kl-coef: -coef * (log pi_old - log pi_ref) per token in the reward. While the actor is the reference
    (step 1, and step 2 after the warm-up step, which does not update it) the penalty is exactly 0 and the returns
    equal the run without it; after the actor's first update (step 2) the step-3 returns differ. The same run trains
    the actor with DAPO-style token-level settings (token-mean aggregation, clip-higher, an entropy bonus), which the
    critic's phase does not read; the entropy term is in the actor's loss once the actor trains."""
    straight, *_ = launched["ppo"].result()
    with_kl = launched["reward_kl"].result()
    assert [m["step"] for m in with_kl] == [1, 2, 3] and all("perf/time/ref_logprobs" in m for m in with_kl)
    for step in (0, 1):
        assert with_kl[step]["critic/returns/mean"] == straight[step]["critic/returns/mean"]
    assert with_kl[2]["critic/returns/mean"] != straight[2]["critic/returns/mean"]
    assert all("actor/entropy" in m for m in with_kl[1:]) and "actor/entropy_loss" not in straight[1]
    for m in with_kl[1:]:  # -0.001 x the token mean of the entropy (token-mean aggregation)
        assert m["actor/entropy_loss"] == pytest.approx(-0.001 * m["actor/entropy"], rel=0.2)
