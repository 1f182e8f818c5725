"""A rollout cluster that did not come back (``--rollout-cluster-reconnect-seconds``, docs/architecture.md §6.3).

Ray-free, so that every rank can stop on it: the driver's fleet raises :class:`RolloutClusterLost` once the head has
been gone for the whole window; the driver then sends the stop in place of the step's rollouts
(:func:`megatron_pacs.distribute.send_stop`) and the other ranks raise the same exception out of their wait for
them. Every rank then saves the last step whose update the weights hold if it has no checkpoint yet, and exits 1
(:mod:`megatron_pacs.train`), or 0 after the exit signal (a scheduler stopping the job stops its Ray cluster too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["FOLLOWER_LINE", "RolloutClusterLost", "lost_line", "stopped_with_the_job"]

FOLLOWER_LINE = (
    "stopped with rank 0, which could not go on (its line names the cause: the rollout cluster lost, or a write "
    "into --log-dir failed)"
)
"""What a rank other than 0 says when the driver's stop reaches it."""


class RolloutClusterLost(RuntimeError):
    """The rollout cluster's head was lost and did not answer again within ``--rollout-cluster-reconnect-seconds``;
    its message is the one line the run exits with."""


def lost_line(address: str, seconds: float, waited: float) -> str:
    """The one line naming the address and the flag.

    Args:
        address: ``--ray-address`` (``ray://host:port``).
        seconds: ``--rollout-cluster-reconnect-seconds``.
        waited: Seconds from the loss's detection to giving up.
    """
    return (
        f"the rollout cluster at {address} was lost and did not come back within {seconds:g} s "
        f"(--rollout-cluster-reconnect-seconds; waited {waited:.0f} s): every rank saved the last completed step; "
        "start the rollout cluster again, then the same command resumes (or raise the flag)"
    )


@contextmanager
def stopped_with_the_job(signalled: Callable[[], bool]) -> Iterator[None]:
    """Around the driver's calls to the rollout side: when the exit signal has come by the time of a failure there
    (``signalled()``, asked then: the signal usually arrives during the call), the failure is taken for the rollout
    cluster's own stop (a scheduler signals every step of the job, a hetjob's Ray cluster too) and raised as
    :class:`RolloutClusterLost`, which the loop turns into a clean stop after saving the last update.

    Args:
        signalled: Whether this process has received the exit signal (``--exit-signal-handler``) by now.
    """
    try:
        yield
    except RolloutClusterLost:
        raise
    except Exception as exc:
        if not signalled():
            raise
        raise RolloutClusterLost(f"the rollout side failed after the exit signal: {exc!r}"[:500]) from exc
