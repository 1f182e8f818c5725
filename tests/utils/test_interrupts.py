"""Guards megatron_pacs/utils/interrupts.py: a Ctrl-C or SIGTERM that a library swallows still ends the run.

Each case runs in a fresh interpreter (the handlers are process-wide): the signal is sent to the process itself
while a bare ``except:`` (as some libraries have) is running, and :func:`raise_if_swallowed` must raise it again.
"""

import signal
import subprocess
import sys
import textwrap

import pytest

SWALLOWED = textwrap.dedent(
    """
    import os, signal, time
    from megatron_pacs.utils.interrupts import (
        Terminated, raise_if_swallowed, raise_on_sigint, raise_on_sigterm
    )

    raise_on_sigterm()
    raise_on_sigint()
    raise_if_swallowed()  # nothing received: nothing raised
    try:  # a library's bare except around where the signal lands
        os.kill(os.getpid(), signal.{signal})
        time.sleep(5)
    except:  # noqa: E722
        pass
    try:
        raise_if_swallowed()
    except (KeyboardInterrupt, Terminated) as exc:
        print("raised again:", type(exc).__name__)
    """
)


@pytest.mark.parametrize(("sig", "raised"), [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "Terminated")])
def test_a_signal_a_library_swallowed_is_raised_again_at_the_next_boundary(sig, raised):
    proc = subprocess.run(
        [sys.executable, "-c", SWALLOWED.format(signal=sig)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"raised again: {raised}"


STUCK_SHUTDOWN = textwrap.dedent(
    """
    import os, signal, time
    from megatron_pacs.utils import interrupts

    interrupts.SIGTERM_GRACE_S = 2.0
    interrupts.raise_on_sigterm()
    interrupts.raise_on_sigint()
    try:
        os.kill(os.getpid(), signal.{signal})
        time.sleep(5)
    except (KeyboardInterrupt, interrupts.Terminated):
        with interrupts.waiting_for("step 3's checkpoint writer"):  # a shutdown that hangs
            os.kill(os.getpid(), signal.{signal})  # pressed again: one line, the shutdown goes on
            time.sleep(30)
    """
)


@pytest.mark.parametrize(
    ("sig", "code", "line"), [("SIGINT", 130, "interrupted by Ctrl-C (SIGINT)"), ("SIGTERM", 143, "stopped by SIGTERM")]
)
def test_a_stuck_shutdown_ends_after_the_grace_naming_what_it_waited_for(sig, code, line):
    """Issue 53, item 1: after Ctrl-C the shutdown's wait for a save had no bound (SIGTERM had a 60 s watchdog,
    SIGINT none), and a second Ctrl-C printed 79 lines. Both signals now start the watchdog, whose line names what
    the shutdown waited for, and a second signal is answered with one line. A fresh interpreter, about 3 s."""
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_SHUTDOWN.format(signal=sig)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{sig} again: still stopping (the shutdown ends within 2s)",
        f"{line} (the shutdown took over 2s, waiting for step 3's checkpoint writer); exiting {code}",
    ]


LIBRARY_CTRL_C = textwrap.dedent(
    """
    import atexit, ctypes, os, signal, sys, time
    from megatron_pacs.utils.interrupts import end_process, raise_on_sigint

    raise_on_sigint()
    # a library running Python code through PyRun_String (pybind11's py::exec) that a Ctrl-C passes through
    run = ctypes.pythonapi.PyRun_String
    run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    if sys.argv[1] == "late":  # a run that ended, and Ctrl-C while the process exits
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))
    else:
        try:
            run(b"import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(5)", 257, {{}}, {{}})
        except KeyboardInterrupt:
            print("caught", flush=True)
    {end}(int(sys.argv[2]))
    """
)


def _run_module(tmp_path, source, *args):
    """``python -m`` of ``source`` (the entry point's form: a module run ends through ``Py_RunMain``'s check)."""
    (tmp_path / "entry.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "entry", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("late", [False, True])
def test_the_entry_points_exit_status_is_the_runs_whatever_a_ctrl_c_passed_through(tmp_path, late):
    """Issue 53's Ctrl-C probe: 4 of 50 runs printed "exiting 130" (or had ended) and exited by SIGINT (-2). A Ctrl-C
    that passed through a library's ``PyRun_String`` sets CPython's flag for an unhandled Ctrl-C, and the interpreter
    then kills itself with SIGINT after its exit; and a Ctrl-C during the teardown, once the handlers are reset,
    ends the process by SIGINT. ``end_process`` (train.py's exit) exits with the run's status, one line for a late
    Ctrl-C; ``sys.exit``, the control, shows the flag's effect. Fresh interpreters, about 2 s."""
    args = ["late", "0"] if late else ["-", "130"]
    ours = _run_module(tmp_path, LIBRARY_CTRL_C.format(end="end_process"), *args)
    assert ours.stdout.strip() == ("" if late else "caught"), ours.stderr
    assert ours.returncode == int(args[1]), ours.stderr
    expected = ["SIGINT while the process exits; the run had ended"] if late else []
    assert ours.stderr.splitlines() == expected
    if not late:
        plain = _run_module(tmp_path, LIBRARY_CTRL_C.format(end="sys.exit"), *args)
        assert plain.returncode == -signal.SIGINT, plain.stderr
