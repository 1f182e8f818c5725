"""The reference policy through the real trainer (fleet, scorer, Megatron; fp32 on CPU), from the golden fixture's
warmed-up model, whose rewards are mixed.

- Invariants (docs/algorithm.md §2.2, §2.7): with one mini-batch per step, at step 1 and right after a reset
  theta = theta_ref, so ``ref/kl`` is exactly 0, the scores anchored at the reference are exactly 0, and the PACS
  loss equals the one anchored at pi_old; the KL gradient is exactly 0 there, so the first update equals the
  v1 run's bit for bit.
- The KL term is the same whatever the layout: padded or packed micro-batches, PP=2, DP=2 (a perturbed reference
  makes it non-zero from the first token).
- Train/rollout consistency is measured for real at PP=2, DP=2 and T != 1; ``--max-logprob-diff`` stops a run
  whose engines run another dtype, naming the step and the value.

Runs that would see the same rollouts as another replay its dumps (``--rollout-source replay``: the same tokens,
rewards and engine log-probs, without a fleet, whose start is most of a tiny launch's time): the packed, padded and
DP=2 KL runs replay the PP=2 one's step (all start from the same weights and seed), and v1 replays v2_reset's first
two steps (the same first update, bit for bit: the same weights generated step 2).
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.cpu import half_engine_pins
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS, refused_train, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GOLDEN = Path(__file__).parent / "golden"
ONE_MINI = ["--ppo-mini-batch-size", "4"]  # global batch 4: one optimizer step per training step
V2 = ["--pacs-score-reference", "ref"]
KL = ["--loss", "grpo", "--kl-coef", "0.1", "--kl-estimator", "k3"]


def _perturbed_reference(root: Path) -> Path:
    """The fixture model with every weight moved a little: a reference that differs from the start."""
    from safetensors.torch import load_file, save_file

    ref = root / "ref_model"
    shutil.copytree(root / "model", ref)
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(str(ref / "model.safetensors"))
    tensors = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return ref


RUNS = {
    # name: (world, flags)
    "v2_reset": (1, [*V2, *ONE_MINI, "--kl-coef", "0.05", "--ref-reset-interval", "2", "--train-iters", "3"]),
    "v1": (1, [*ONE_MINI, "--train-iters", "2"]),
    "kl_pp2": (2, [*KL, "--ref-load", "REF", "--pipeline-model-parallel-size", "2", "--train-iters", "1"]),
    "kl_packed": (1, [*KL, "--ref-load", "REF", "--train-iters", "1"]),
    "kl_padded": (1, [*KL, "--ref-load", "REF", "--no-sequence-packing", "--train-iters", "1"]),
    "kl_dp2": (2, [*KL, "--ref-load", "REF", "--train-iters", "1"]),
    # sampling at T = 0.7: the consistency check compares the engines' raw (T = 1) log-probs with the trainer's
    # extra T = 1 pass; bounded, in sync, so the run completes
    "t07": (1, ["--temperature", "0.7", "--max-logprob-diff", "1e-3", "--train-iters", "1"]),
}
# run -> the run whose dumps it replays (after it, in the same launch of the queue)
REPLAYS = {"v1": "v2_reset", "kl_packed": "kl_pp2", "kl_padded": "kl_pp2", "kl_dp2": "kl_pp2"}


def prepare(root: Path) -> tuple[Path, Path]:
    shutil.copytree(GOLDEN / "model", root / "model")
    shutil.copy(GOLDEN / "train.jsonl", root / "train.jsonl")
    return root, _perturbed_reference(root)


def _launch(prepared: tuple[Path, Path], name: str) -> dict[str, list[dict]]:
    """Run ``name`` with the fleet, then the runs that replay its dumps; returns each run's metrics by its name."""
    root, ref = prepared
    out = {}
    for run in (name, *(r for r, source in REPLAYS.items() if source == name)):
        world, extra = RUNS[run]
        extra = [str(ref) if a == "REF" else a for a in extra]
        flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl")]
        if run in REPLAYS:
            flags += [*TINY_TRAIN_FLAGS, "--rollout-source", "replay", "--replay-from", str(root / name)]
        else:
            flags += TINY_RUN_FLAGS
        flags += ["--micro-batch-size", "3", *extra]
        out[run] = run_train(flags, log_dir=root / run, cwd=root, world=world, without_fleet_stack=run in REPLAYS)
    return out


def _bf16_engines(prepared: tuple[Path, Path]) -> dict[str, str]:
    """One step with bf16 engines beside the fp32 trainer and ``--max-logprob-diff 1e-3``: the run's stderr."""
    root, _ = prepared
    flags = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), *TINY_RUN_FLAGS]
    flags += ["--train-iters", "1", "--max-logprob-diff", "1e-3", "--rollout-dtype", "bfloat16"]
    return {"bf16_engines": refused_train(flags, log_dir=root / "bound", cwd=root, pins=half_engine_pins())}


# queued for the session (tests/launch_queue.py)
LAUNCHES = {name: partial(_launch, name=name) for name in RUNS if name not in REPLAYS}
LAUNCHES["bf16_engines"] = _bf16_engines


@pytest.fixture(scope="module")
def runs(launch_queue) -> tuple[Path, dict[str, list[dict]]]:
    futures = launch_queue.futures(__name__).values()
    out = {name: history for future in futures for name, history in future.result().items()}
    return launch_queue.root(__name__), out


def _steps(history: list[dict]) -> list[dict]:
    return [m for m in history if "train/loss" in m]


def test_at_the_reference_kl_and_scores_are_exactly_zero_and_the_loss_is_v1s(runs):
    _, out = runs
    v2, v1 = _steps(out["v2_reset"]), _steps(out["v1"])
    assert [m["ref/resets"] for m in v2] == [0.0, 1.0, 1.0]  # reset at the end of step 2
    for m in (v2[0], v2[2]):  # step 1, and step 3 right after the reset
        assert m["ref/kl"] == 0.0 and m["ref/kl_loss"] == 0.0
        assert m["pacs/score/max"] == 0.0 and m["pacs/score/min"] == 0.0
        assert m["pacs/loss"] == v1[0]["pacs/loss"]  # the s = 0 loss v1 has at its first mini-batch
    assert v2[1]["ref/kl"] > 0.0 and v2[1]["pacs/score/max"] > 0.0  # in between, the anchor has drifted
    # s = 0 is known there, so no phase-1 pass runs (it would only add the rounding of another cut of the batch)
    assert "perf/time/phase1" not in v2[0] and "perf/time/phase1" not in v2[2] and "perf/time/phase1" in v2[1]
    # At theta = theta_ref the KL gradient is exactly zero and both anchors give s = 0: the same first update.
    assert v2[0]["train/grad_norm"] == v1[0]["train/grad_norm"]
    # v1 replays v2's rollouts: its step-2 log-probs equal v2's to the bit (the same weights after step 1), both
    # compared with the engines' recorded log-probs
    for key in ("consistency/logprob_abs_diff_max", "consistency/logprob_abs_diff_mean", "consistency/k3"):
        assert v2[1][key] == v1[1][key], key


@pytest.mark.parametrize("other", ["kl_padded", "kl_pp2", "kl_dp2"])
def test_the_kl_term_does_not_depend_on_packing_pipeline_or_data_parallelism(runs, other):
    """The same rollouts (kl_pp2's; the others replay them) and reference in every layout."""
    _, out = runs
    base, m = _steps(out["kl_packed"])[0], _steps(out[other])[0]
    assert base["ref/kl"] > 1e-4  # a real KL from the first token (perturbed reference)
    for key in ("ref/kl", "ref/kl_loss", "train/loss", "train/grad_norm"):
        assert m[key] == pytest.approx(base[key], rel=1e-5), key


@pytest.mark.parametrize("name", ["kl_packed", "kl_pp2", "kl_dp2", "t07"])
def test_consistency_is_measured_for_real_at_every_layout_and_temperature(runs, name):
    """Engine vs trainer log-probs of the same tokens under the same weights, compared on the last pipeline stage
    (PP=2 too) and over every data-parallel rank's tokens (kl_packed and kl_dp2 against the engine log-probs
    recorded by kl_pp2's fleet); fp32 on CPU: rounding only. The sync probe (vLLM's prompt log-probs after the sync)
    runs under PP as well (at DP=2: tests/mcore/test_moe.py's EP=2 run)."""
    _, out = runs
    m = _steps(out[name])[0]
    assert 0.0 <= m["consistency/logprob_abs_diff_max"] < 1e-4  # compared, and it agrees
    assert m["consistency/logprob_abs_diff_mean"] <= m["consistency/logprob_abs_diff_max"]
    assert m["consistency/seq_logprob_abs_diff_max"] < 1e-3
    assert 0.0 <= m["consistency/k3"] < 1e-8
    if name in REPLAYS:
        assert "sync/max_logprob_diff" not in m and "perf/time/generate" not in m  # no engines
    else:
        assert 0.0 <= m["sync/max_logprob_diff"] < 1e-4


def test_max_logprob_diff_stops_a_run_whose_engines_run_another_dtype(runs):
    """Engines in bf16 beside an fp32 trainer (``--rollout-dtype bfloat16``) disagree by ~1e-2 per token: the run
    stops at step 1 naming the step, the value and the bound (a run in sync passes the same bound: ``t07``)."""
    stderr = runs[1]["bf16_engines"]
    assert "step 1:" in stderr and "--max-logprob-diff 0.001" in stderr, stderr[-3000:]
