"""A rollout cluster that did not come back (``--rollout-cluster-reconnect-seconds``, docs/architecture.md §6.3).

Ray-free, so that every rank can stop on it: the driver's fleet raises :class:`RolloutClusterLost` once the head has
been gone for the whole window; the driver then sends the stop in place of the step's rollouts
(:func:`megatron_pacs.distribute.send_stop`) and the other ranks raise the same exception out of their wait for
them. Every rank then saves the last step whose update the weights hold if it has no checkpoint yet, and exits 1
(:mod:`megatron_pacs.train`), or 0 after the exit signal (a scheduler stopping the job stops its Ray cluster too).
"""

from __future__ import annotations

__all__ = ["FOLLOWER_LINE", "RolloutClusterLost", "lost_line"]

FOLLOWER_LINE = "stopped with rank 0, which lost the rollout cluster (its line names the address and the flag)"
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
