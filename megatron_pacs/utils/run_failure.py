"""A run-level failure that a user can act on: the run ends with its one line, not a traceback.

The entry point (:mod:`megatron_pacs.train`) prints ``error: <message>`` and exits 1 for a :class:`RunFailure`, as
for a full disk or a lost rollout cluster: the message already says what happened, the flag involved and the fix,
and a 30-line traceback (``[rank0]:`` prefixed under torchrun) only buries it. A failure whose cause is a bug keeps
its traceback: raise this only where the message is the whole story.
"""

from __future__ import annotations

__all__ = ["RunFailure"]


class RunFailure(RuntimeError):
    """The run cannot go on for a reason its message names with the fix (e.g. ``--filter-groups zero-variance`` found
    no group to train on within ``--max-filter-rounds``). ``str()`` is the one line the run stops with."""
