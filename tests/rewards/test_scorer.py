"""RewardScorer: real worker processes, hard per-item timeouts, crashes, pathological inputs."""

import os
import time

import pytest

from megatron_pacs.rewards import RewardScorer


def sleepy_reward(response, ground_truth):
    """A reward that hangs and ignores signals' intent: only a hard kill stops it."""
    if response == "hang":
        time.sleep(600)
    return 1.0 if response == ground_truth else 0.0


def crashing_reward(response, ground_truth):
    if response == "crash":
        os._exit(3)
    return 1.0


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=2.0) as s:
        yield s


def test_batch_in_order_with_pathological_inputs(scorer):
    responses = [
        "\\boxed{\\frac{1}{2}}",
        "{" * 500_000 + "}" * 500_000,  # 1 MB of nested braces
        "\\boxed{" + "9" * 10_000 + "}",  # a 10,000-digit number
        "\\boxed{9^{9^{9^{9}}}}",  # a power tower: math-verify works on it for ~5 s
        None,
        12,
        "\\boxed{27}",
        "\\boxed{3}",
    ]
    truths = ["0.5", "1", "1", "1", "1", "1", "27.0", "4"]
    t0 = time.monotonic()
    out = scorer.score(responses, truths)
    elapsed = time.monotonic() - t0
    assert out.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert out.statuses[1] == "too_long" and out.num_too_long == 1
    assert out.statuses[3] == "timeout" and out.num_timeouts == 1
    assert out.statuses[4] == out.statuses[5] == "error" and out.num_errors == 2
    assert elapsed < 15, f"a batch with one 2 s timeout took {elapsed:.1f}s"
    # The killed worker was replaced: the pool still works.
    assert scorer.score(["\\boxed{2}"] * 4, ["2"] * 4).scores == [1.0] * 4
    assert scorer.total_timeouts >= 1


def test_hard_timeout_kills_a_hanging_reward():
    with RewardScorer(num_workers=1, timeout_s=1.0, reward_fn=sleepy_reward) as s:
        t0 = time.monotonic()
        out = s.score(["a", "hang", "b"], ["a", "x", "b"])
        assert time.monotonic() - t0 < 30
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.statuses == ["ok", "timeout", "ok"]


def test_crashed_worker_counts_an_error_and_is_replaced():
    with RewardScorer(num_workers=1, timeout_s=5.0, reward_fn=crashing_reward) as s:
        out = s.score(["x", "crash", "y"], ["1", "1", "1"])
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.num_errors == 1


def test_serial_mode_and_argument_errors():
    out = RewardScorer(num_workers=0).score(["\\boxed{1}", 3], ["1", "1"])
    assert out.scores == [1.0, 0.0] and out.num_errors == 1
    with pytest.raises(ValueError, match="one ground truth per response"):
        RewardScorer(num_workers=0).score(["a"], [])
    with pytest.raises(ValueError, match="timeout_s=0"):
        RewardScorer(timeout_s=0)
