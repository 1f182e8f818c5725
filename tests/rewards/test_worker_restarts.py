"""A reward worker killed and replaced is counted: ``reward/worker_restarts`` of the
batch it happened in, whether the worker was killed from outside between batches or ended by the pool past its
time-out. Real worker processes."""

import time

from megatron_pacs.rewards import RewardScorer


def exact(response, ground_truth):
    """A reward with no imports to warm up: the pool starts in the time of a spawn."""
    if response == "hang":
        time.sleep(600)
    return 1.0 if response == ground_truth else 0.0


def test_a_killed_reward_worker_is_replaced_and_counted():
    with RewardScorer(num_workers=1, timeout_s=1.0, reward_fn=exact) as scorer:
        first = scorer.score(["1"], ["1"])
        assert first.num_worker_restarts == 0 and first.metrics()["reward/worker_restarts"] == 0.0
        scorer._workers[0].proc.kill()  # as an OOM killer or a user would, between two steps
        scorer._workers[0].proc.join()
        second = scorer.score(["2"], ["2"])
        assert second.scores == [1.0] and second.metrics()["reward/worker_restarts"] == 1.0
        third = scorer.score(["hang", "3"], ["1", "3"])  # the pool kills the hung worker and starts another
        assert third.statuses == ["timeout", "ok"] and third.num_worker_restarts == 1
        assert scorer.total_worker_restarts == 2
