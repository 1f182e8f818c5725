"""Prompt batches for training steps: reshuffled every epoch, resumable from ``(epoch, position)``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from megatron_pacs.utils.seeding import LOADER_STREAM, seed_sequence

__all__ = ["PromptLoader"]

T = TypeVar("T")


class PromptLoader(Generic[T]):
    """Yields lists of ``batch_size`` items (or of a given size: a step's refill prompts with ``--filter-groups``), a
    new permutation per epoch (seeded), dropping what is left of an epoch when it cannot fill a list. Thread-safe:
    one step off, the background generation draws refill prompts.

    Args:
        items: The dataset.
        batch_size: Items per batch (must not exceed ``len(items)``).
        seed: Shuffle seed; epoch e permutes with the independent stream ``SeedSequence(seed, spawn_key=(0, e))``
            (``utils.seeding``), so no (seed, epoch) pair replays another's order.
        dropped: Prompts the data set lost before it got here (over ``--max-prompt-length``): reported with every
            step as ``data/dropped_prompts``.
    """

    def __init__(self, items: Sequence[T], batch_size: int, seed: int, *, dropped: int = 0) -> None:
        if batch_size > len(items):
            raise ValueError(
                f"--global-batch-size {batch_size} exceeds the {len(items)} training prompts; lower it or add data"
            )
        self.items, self.batch_size, self.seed, self.dropped = items, batch_size, seed, dropped
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)
        self._lock = threading.Lock()
        self.fingerprint = _fingerprint(items)
        self.content_fingerprint = _content_fingerprint(items)

    def _permutation(self, epoch: int) -> list[int]:
        rng = np.random.default_rng(seed_sequence(self.seed, LOADER_STREAM, epoch))
        return [int(i) for i in rng.permutation(len(self.items))]

    def next_batch(self, size: int | None = None) -> list[T]:
        """The next ``size`` items (default ``batch_size``; at most ``batch_size``)."""
        size = self.batch_size if size is None else size
        if not 0 < size <= self.batch_size:
            raise ValueError(f"a draw of {size} prompts: draws take 1 to --global-batch-size {self.batch_size}")
        with self._lock:
            if self.position + size > len(self.items):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            idx = self._order[self.position : self.position + size]
            self.position += size
        return [self.items[i] for i in idx]

    def next_rows(self, size: int) -> list[T]:
        """The next ``size`` items at most, never past the epoch's end: the asynchronous stream's draws, which come
        in any size and must skip none (:meth:`next_batch` starts a new epoch when the rest does not fit)."""
        with self._lock:
            left = len(self.items) - self.position
        return self.next_batch(min(size, self.batch_size, left) if left > 0 else min(size, self.batch_size))

    def state_dict(self) -> dict[str, Any]:
        """The position, with the data set's size and fingerprints (a position only means something for them)."""
        with self._lock:
            epoch, position = self.epoch, self.position
        return {
            "epoch": epoch,
            "position": position,
            "num_items": len(self.items),
            "fingerprint": self.fingerprint,
            "content_fingerprint": self.content_fingerprint,
        }

    def check_state_dict(self, state: dict[str, Any], *, allow_changed_rows: bool = False) -> bool:
        """Check that a saved position belongs to these items (what the state records: states written before the
        content fingerprint existed are checked by their ids only).

        Args:
            state: A :meth:`state_dict`.
            allow_changed_rows: Accept rows whose content changed under the same ids in the same order.

        Returns:
            Whether the rows' content changed (accepted with ``allow_changed_rows``).

        Raises:
            ValueError: naming --train-data, when the saved position belongs to other data, or to rows whose content
                changed (without ``allow_changed_rows``).
        """
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise ValueError(
                f"--train-data: the checkpoint's data position belongs to another data set "
                f"({state.get('num_items')} prompts, fingerprint {saved[:12]}) than this one ({len(self.items)} "
                f"prompts, {self.fingerprint[:12]}): resuming would skip some prompts and repeat others; pass the "
                "same prepared files in the same order, or start a new run"
            )
        content = state.get("content_fingerprint")
        if content is None or content == self.content_fingerprint:
            return False
        if not allow_changed_rows:
            raise ValueError(
                f"--train-data: the rows have the checkpoint's ids in its order, but their content changed "
                f"(content fingerprint {content[:12]} in the checkpoint, {self.content_fingerprint[:12]} now): the "
                "resumed run would train on other prompts or answers than the record says; pass the same prepared "
                "files, or add --allow-changed-rows to resume on the changed rows (a corrected answer)"
            )
        return True

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_rows: bool = False) -> None:
        """Restore a position saved for the same items in the same order (:meth:`check_state_dict`).

        Raises:
            ValueError: naming --train-data, when the saved position belongs to other data.
        """
        self.check_state_dict(state, allow_changed_rows=allow_changed_rows)
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._order = self._permutation(self.epoch)


def _fingerprint(items: Sequence[Any]) -> str:
    """SHA-256 of the items' identities in order: ``(data_source, id)`` for prompt rows, else their ``repr``."""
    h = hashlib.sha256()
    for item in items:
        key = (getattr(item, "data_source", None), item.id) if hasattr(item, "id") else item
        h.update(repr(key).encode("utf-8") + b"\n")
    return h.hexdigest()


def _content_fingerprint(items: Sequence[Any]) -> str:
    """SHA-256 of the items' content in order: every field of a dataclass row (canonical JSON), else ``repr``."""
    h = hashlib.sha256()
    for item in items:
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            text = json.dumps(dataclasses.asdict(item), sort_keys=True, default=repr)
        else:
            text = repr(item)
        h.update(text.encode("utf-8") + b"\n")
    return h.hexdigest()
