"""rollout.lost.stopped_with_the_job: a failure of the rollout side is the job's own stop only when the exit signal
has come by the time it fails (a hetjob's Ray cluster is signalled with the trainers, and dies during the call)."""

import pytest

from megatron_pacs.rollout.lost import RolloutClusterLost, stopped_with_the_job


def test_a_failure_without_the_exit_signal_is_raised_as_it_is():
    with pytest.raises(ConnectionError, match="head gone"), stopped_with_the_job(lambda: False):
        raise ConnectionError("head gone")


def test_a_signal_that_arrives_during_the_call_makes_its_failure_the_jobs_stop():
    received: list[float] = []  # what the signal handler fills in, mid-call
    with pytest.raises(RolloutClusterLost, match="failed after the exit signal") as caught:
        with stopped_with_the_job(lambda: bool(received)):
            received.append(1.0)
            raise ConnectionError("Ray Client: connection to the head closed")
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_the_fleets_own_loss_passes_through_unchanged():
    lost = RolloutClusterLost("the rollout cluster at ray://h:10001 was lost")
    with pytest.raises(RolloutClusterLost) as caught, stopped_with_the_job(lambda: True):
        raise lost
    assert caught.value is lost and caught.value.__cause__ is None
