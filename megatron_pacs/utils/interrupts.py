"""SIGTERM and Ctrl-C outside ``--exit-signal-handler``: the run ends with one line, not a traceback.

Python turns Ctrl-C (SIGINT) into ``KeyboardInterrupt``; :func:`raise_on_sigterm` turns SIGTERM into
:class:`Terminated` the same way, so that both unwind the run (the trainer's ``close`` stops the engines and the
reward pool) and reach ``train.py``'s entry point, which prints one line and exits 130 or 143 (128 + the signal, as
a shell reports a process the signal ended). Raised where the main thread happens to be, the exception can surface
wrapped (Ray's Cython code turns it into a ``SystemError`` whose cause it is: :func:`interruption_of` finds it) or
be swallowed (raised inside a ``__del__``); for the latter a watchdog ends the process, its children with it, when
it has not exited :data:`SIGTERM_GRACE_S` after the signal.

Ray's ``ray.init`` installs a SIGTERM handler of its own in the driver (``sys.exit``); the fleet's start keeps this
one (:mod:`megatron_pacs.rollout.fleet.ray_start`). ``--exit-signal-handler`` replaces it after the start-up: SIGTERM
then stops the run at a step boundary (:mod:`megatron_pacs.utils.exit_signal`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = [
    "EXIT_CODES",
    "SIGTERM_GRACE_S",
    "Terminated",
    "interrupted_line",
    "interruption_of",
    "raise_on_sigterm",
    "raises_on_sigterm",
]

EXIT_CODES = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
"""The exit status of a run ended by each signal (130, 143)."""

SIGTERM_GRACE_S = 60.0
"""Seconds from SIGTERM to the watchdog's end of the process, when the unwinding has not ended it by then."""


class Terminated(BaseException):
    """SIGTERM arrived (:func:`raise_on_sigterm`). A ``BaseException``, as ``KeyboardInterrupt``: the run's
    ``except Exception`` handlers let it through to the entry point."""


def _end_after_grace() -> None:
    """The watchdog: the process and its children end :data:`SIGTERM_GRACE_S` after SIGTERM, whatever happens."""
    threading.Event().wait(SIGTERM_GRACE_S)
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    print(f"stopped by SIGTERM (the shutdown took over {SIGTERM_GRACE_S:.0f}s); exiting 143", file=sys.stderr)
    os._exit(EXIT_CODES["SIGTERM"])


def _raise(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: a second would cut the shutdown short
    threading.Thread(target=_end_after_grace, name="sigterm-watchdog", daemon=True).start()
    raise Terminated()


def raise_on_sigterm() -> None:
    """From here on (main thread), SIGTERM raises :class:`Terminated` where the main thread is."""
    signal.signal(signal.SIGTERM, _raise)


def raises_on_sigterm() -> bool:
    """Whether SIGTERM raises :class:`Terminated` here (:func:`raise_on_sigterm` was called, nothing replaced it)."""
    return signal.getsignal(signal.SIGTERM) is _raise


def interruption_of(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` or :class:`Terminated` that ``exc`` is or was raised from (its causes and contexts),
    or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (KeyboardInterrupt, Terminated)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def interrupted_line(exc: BaseException) -> tuple[str, int]:
    """The line a run ended by ``exc`` (``KeyboardInterrupt`` or :class:`Terminated`) prints, and its exit status."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted by Ctrl-C (SIGINT); exiting {EXIT_CODES['SIGINT']}", EXIT_CODES["SIGINT"]
    return f"stopped by SIGTERM; exiting {EXIT_CODES['SIGTERM']}", EXIT_CODES["SIGTERM"]
