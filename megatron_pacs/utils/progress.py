"""Progress bars that draw in a terminal and stay quiet elsewhere.

tqdm redraws its bar with carriage returns; written into a file or a scheduler's log, every redraw is a new frame.
So a bar is drawn only when its stream is a terminal: elsewhere the run's one log line per step says the same.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

__all__ = ["progress_bar"]


def progress_bar(start: int, total: int, *, enabled: bool = True, desc: str = "train", unit: str = "step") -> Any:
    """A bar over ``range(start, total)`` that starts at ``start``: drawn on a terminal's stderr, silent otherwise.

    Args:
        start: Steps already done (a resumed run).
        total: Steps in all.
        enabled: False draws nothing wherever (e.g. every rank but the driver).
        desc: The bar's label.
        unit: What one iteration is.
    """
    terminal = sys.stderr is not None and sys.stderr.isatty()
    return tqdm(
        range(start, total), desc=desc, unit=unit, disable=not (enabled and terminal), initial=start, total=total
    )
