"""Wall-clock time per phase of a step: :class:`PhaseTimer`, reported as ``perf/time/<phase>`` metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulate wall-clock seconds per named phase of a step.

    Example::

        timer = PhaseTimer()
        with timer.phase("generate"):
            ...
        metrics.update(timer.collect())  # {"perf/time/generate": 12.3}

    Phases may nest; each is timed on its own (an outer phase includes its inner ones). Re-entering a phase that
    is already open counts the overlap twice.

    Args:
        cuda_sync (bool): Call ``torch.cuda.synchronize()`` at each phase boundary (when CUDA is available) so
            asynchronous GPU work is charged to the phase that launched it.
    """

    def __init__(self, *, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` body and add it to ``name`` (also when the body raises).

        Args:
            name (str): Phase name, e.g. ``"generate"``.
        """
        if self.cuda_sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            self._seconds[name] += time.perf_counter() - start

    def collect(self, prefix: str = "perf/time/") -> dict[str, float]:
        """Return the accumulated seconds per phase and reset them.

        Args:
            prefix (str): Prepended to each phase name.

        Returns:
            dict[str, float]: ``prefix + name -> seconds`` for every phase timed since the last collect.
        """
        out = {prefix + name: secs for name, secs in self._seconds.items()}
        self._seconds.clear()
        return out
