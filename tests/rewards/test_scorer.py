"""RewardScorer: real worker processes, hard per-item timeouts, crashes, pathological inputs."""

import os
import time

import pytest

from megatron_pacs.rewards import RewardScorer


def sleepy_reward(response, ground_truth):
    """A reward that hangs and ignores signals' intent: only a hard kill stops it."""
    if response == "hang":
        time.sleep(600)
    if response == "slow":
        time.sleep(0.5)
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
    # math-verify's own ~5 s limit and the pool's 2 s one race here; either way the item is counted, not "ok".
    assert out.statuses[3] in ("timeout", "verify_timeout") and out.num_timeouts + out.num_verify_timeouts == 1
    assert out.statuses[4] == out.statuses[5] == "error" and out.num_errors == 2
    assert elapsed < 15, f"a batch with one 2 s timeout took {elapsed:.1f}s"
    # The killed worker was replaced: the pool still works.
    assert scorer.score(["\\boxed{2}"] * 4, ["2"] * 4).scores == [1.0] * 4
    assert scorer.total_timeouts >= 1


@pytest.mark.waits
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


@pytest.mark.waits
@pytest.mark.parametrize("num_workers", [1, 2])
def test_replacing_every_worker_late_in_a_batch_is_a_timeout_not_an_error(num_workers):
    """Each worker's start-up deadline runs from its own (re)start, not once per ``score`` call: slow items past
    the first deadline, then hangs that replace every worker at once, come back as timeouts (not "no reward worker
    started") and the rest is scored."""
    start_timeout = 6.0
    slow = ["slow"] * int(2 * num_workers * start_timeout)  # 0.5 s each: the batch outlives the first deadline
    responses = [*slow, *["hang"] * num_workers, "a"]
    with RewardScorer(
        num_workers=num_workers, timeout_s=1.5, reward_fn=sleepy_reward, start_timeout_s=start_timeout
    ) as s:
        t0 = time.monotonic()
        out = s.score(responses, [*slow, *["x"] * num_workers, "a"])
        assert time.monotonic() - t0 > start_timeout  # the old single deadline had passed
    assert out.statuses == ["ok"] * len(slow) + ["timeout"] * num_workers + ["ok"]
    assert out.scores[-1] == 1.0 and out.num_timeouts == num_workers


@pytest.mark.waits
def test_a_pool_whose_workers_never_start_raises(tmp_path):
    """A reward whose module hangs at its import in the workers (a user's function is not called before the
    first item, so only its import can keep a worker from starting)."""
    (tmp_path / "hangs.py").write_text(
        "import multiprocessing, time\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    time.sleep(600)\n"
        "def reward(response, ground_truth):\n"
        "    return 1.0\n"
    )
    with RewardScorer(num_workers=1, reward_fn=f"{tmp_path / 'hangs.py'}:reward", start_timeout_s=3.0) as s:
        with pytest.raises(RuntimeError, match=r"no reward worker started within 3\.0s"):
            s.score(["a"], ["a"])


@pytest.mark.waits
def test_math_verify_time_limit_is_counted_not_hidden():
    """Math-verify's own ~5 s limit is reported as ``verify_timeout`` (not a 0 scored "ok") and counted in
    ``reward/num_verify_timeouts`` (serial mode: no hard timeout can fire first)."""
    with RewardScorer(num_workers=0) as s:
        out = s.score(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{2}", "\\boxed{1}"], ["1", "1", "1"])
    assert out.statuses == ["verify_timeout", "ok", "ok"] and out.scores == [0.0, 0.0, 1.0]
    assert out.num_verify_timeouts == 1 and out.num_errors == 0
    assert out.metrics()["reward/num_verify_timeouts"] == 1.0 and s.total_verify_timeouts == 1


def test_max_chars_is_a_setting_and_counts_truncations():
    """The character cap is --reward-max-chars (None: off), and over-long responses are counted."""
    long_correct = "x" * 200 + "\\boxed{7}"
    with RewardScorer(num_workers=0, max_chars=100) as s:
        out = s.score([long_correct], ["7"])
    assert out.statuses == ["too_long"] and out.metrics()["reward/num_too_long"] == 1.0
    with RewardScorer(num_workers=0, max_chars=None) as s:
        assert s.score([long_correct], ["7"]).scores == [1.0]
    with pytest.raises(ValueError, match="max_chars=0"):
        RewardScorer(max_chars=0)
