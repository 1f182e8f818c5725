"""Guards megatron_pacs/utils/interrupts.py: a Ctrl-C or SIGTERM that a library swallows still ends the run.

Each case runs in a fresh interpreter (the handlers are process-wide): the signal is sent to the process itself
while a bare ``except:`` (as some libraries have) is running, and :func:`raise_if_swallowed` must raise it again.
"""

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
