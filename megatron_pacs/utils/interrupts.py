"""SIGTERM and Ctrl-C outside ``--exit-signal-handler``: the run ends with one line, not a traceback.

Python turns Ctrl-C (SIGINT) into ``KeyboardInterrupt``; :func:`raise_on_sigterm` turns SIGTERM into
:class:`Terminated` the same way, so that both unwind the run (the trainer's ``close`` stops the engines and the
reward pool) and reach ``train.py``'s entry point, which prints one line and exits 130 or 143 (128 + the signal, as
a shell reports a process the signal ended). Raised where the main thread happens to be, the exception can surface
wrapped (Ray's Cython code turns it into a ``SystemError`` whose cause it is: :func:`interruption_of` finds it) or
be swallowed (raised inside a ``__del__``, or caught by a library's bare ``except:``). Both handlers record the
signal, so :func:`raise_if_swallowed`, called at each step boundary, raises a swallowed one again there; and after
either signal a watchdog ends the process, its children with it, when it has not exited :data:`SIGTERM_GRACE_S`
after the signal, naming what the shutdown was waiting for (:func:`waiting_for`). A second signal while the run
stops does not cut the shutdown short (a Ctrl-C pressed again printed 79 lines of tracebacks): it is answered with
one line.

Ray's ``ray.init`` installs a SIGTERM handler of its own in the driver (``sys.exit``); the fleet's start keeps this
one (:mod:`megatron_pacs.rollout.fleet.ray_start`). ``--exit-signal-handler`` replaces it after the start-up: SIGTERM
then stops the run at a step boundary (:mod:`megatron_pacs.utils.exit_signal`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

__all__ = [
    "EXIT_CODES",
    "SIGTERM_GRACE_S",
    "Terminated",
    "end_process",
    "exiting",
    "interrupt_received",
    "interrupted_line",
    "interruption_of",
    "raise_if_swallowed",
    "raise_on_sigint",
    "raise_on_sigterm",
    "raises_on_sigterm",
    "waiting_for",
]

EXIT_CODES = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
"""The exit status of a run ended by each signal (130, 143)."""

SIGTERM_GRACE_S = 60.0
"""Seconds from SIGTERM or Ctrl-C to the watchdog's end of the process, when the unwinding has not ended it by then
(the default ``--heartbeat-timeout-seconds``: a stopped run ends before its peers would declare it lost)."""


class Terminated(BaseException):
    """SIGTERM arrived (:func:`raise_on_sigterm`). A ``BaseException``, as ``KeyboardInterrupt``: the run's
    ``except Exception`` handlers let it through to the entry point."""


_WAITING: list[str] = []  # what the shutdown waits for now, innermost last (waiting_for)


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Name what the code inside waits for (e.g. "step 3's checkpoint writer"), for the watchdog's line should the
    shutdown outlast :data:`SIGTERM_GRACE_S`."""
    _WAITING.append(what)
    try:
        yield
    finally:
        _WAITING.pop()


def exiting() -> None:
    """Say, for the watchdog's line, that the run is past its shutdown and the interpreter exits (which joins the
    child processes still running)."""
    _WAITING[:] = ["the interpreter's exit (the child processes it joins)"]


def _end_after_grace(name: str) -> None:
    """The watchdog: the process and its children end :data:`SIGTERM_GRACE_S` after the signal, whatever happens."""
    threading.Event().wait(SIGTERM_GRACE_S)
    import psutil

    waiting = f", waiting for {_WAITING[-1]}" if _WAITING else ""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    code = EXIT_CODES[name]
    what = "interrupted by Ctrl-C (SIGINT)" if name == "SIGINT" else "stopped by SIGTERM"
    print(f"{what} (the shutdown took over {SIGTERM_GRACE_S:.0f}s{waiting}); exiting {code}", file=sys.stderr)
    os._exit(code)


_RECEIVED: list[str] = []  # the signals the handlers below turned into exceptions, in order


def _first(name: str) -> bool:
    """Record signal ``name``; True for the run's first stop signal (which starts the watchdog), False for a later
    one, which is answered with one line and otherwise ignored (the shutdown it would interrupt is under way)."""
    if _RECEIVED:
        print(f"{name} again: still stopping (the shutdown ends within {SIGTERM_GRACE_S:.0f}s)", file=sys.stderr)
        return False
    _RECEIVED.append(name)
    threading.Thread(target=_end_after_grace, args=(name,), name="stop-watchdog", daemon=True).start()
    return True


def _raise(signum: int, frame: FrameType | None) -> None:
    if _first("SIGTERM"):
        raise Terminated()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if _first("SIGINT"):
        raise KeyboardInterrupt()


def raise_on_sigint() -> None:
    """From here on (main thread), Ctrl-C raises ``KeyboardInterrupt`` as Python's own handler does, and records it
    for :func:`raise_if_swallowed`."""
    signal.signal(signal.SIGINT, _interrupt)


def raise_if_swallowed() -> None:
    """Raise again a Ctrl-C or SIGTERM that its handler raised and something swallowed since.

    Call where no interruption can be unwinding: a step boundary. A run's own code lets both exceptions through, but
    a library's bare ``except:`` can catch one that surfaced inside it (a suite run once trained all its steps and
    exited 0 after a Ctrl-C during the start-up); the run then stops at the next boundary instead.

    Raises:
        KeyboardInterrupt: Ctrl-C was received (:func:`raise_on_sigint`).
        Terminated: SIGTERM was received (:func:`raise_on_sigterm`).
    """
    if not _RECEIVED:
        return
    if _RECEIVED[0] == "SIGINT":
        raise KeyboardInterrupt()
    raise Terminated()


def interrupt_received() -> bool:
    """Whether Ctrl-C or SIGTERM has been received (the run is stopping, or will at the next step boundary)."""
    return bool(_RECEIVED)


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


def _recorded(signum: int, frame: FrameType | None) -> None:
    """A stop signal once the run has ended: recorded (the watchdog bounds the exit), nothing raised."""
    name = signal.Signals(signum).name
    if _first(name):
        print(f"{name} while the process exits; the run had ended", file=sys.stderr)


def end_process(code: int) -> NoReturn:
    """End the process with ``code``: the interpreter's own exit (join the non-daemon threads, run ``atexit``, as
    ``Py_FinalizeEx`` does first) under the watchdog's bound, then ``os._exit``.

    Not ``sys.exit``, for two causes the Ctrl-C probe found (tools/ctrl_c_probe.py, 4 of 50 trials exited -2, i.e.
    by SIGINT): a ``KeyboardInterrupt`` that passed through a library's ``PyRun_String`` (pybind11's ``py::exec``)
    sets CPython's flag for an unhandled Ctrl-C even when the run caught it later, and the interpreter then kills
    itself with SIGINT after its teardown, whatever status the run chose; and once the teardown has reset the signal
    handlers, a Ctrl-C ends a run that had finished by SIGINT, silently. From here on a stop signal only starts the
    watchdog.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _recorded)
    exiting()
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def interrupted_line(exc: BaseException) -> tuple[str, int]:
    """The line a run ended by ``exc`` (``KeyboardInterrupt`` or :class:`Terminated`) prints, and its exit status."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted by Ctrl-C (SIGINT); exiting {EXIT_CODES['SIGINT']}", EXIT_CODES["SIGINT"]
    return f"stopped by SIGTERM; exiting {EXIT_CODES['SIGTERM']}", EXIT_CODES["SIGTERM"]
