"""``--exit-signal-handler``'s latch (megatron_pacs/utils/exit_signal.py) in a real process receiving SIGTERM: the
signal is recorded instead of ending the process, and the watchdog ends it when the grace period runs out first.
(The multi-host behaviour, every rank stopping at one step boundary and saving, is tests/cluster/test_faults.py.)"""

import subprocess
import sys
import time

import pytest

SCRIPT = """
import os, signal, sys, time
from megatron_pacs.utils.exit_signal import ExitSignal
latch = ExitSignal(grace_seconds=float(sys.argv[1]))
assert not latch.should_stop()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)  # the handler runs between bytecodes
print("stop", latch.should_stop(), flush=True)
if sys.argv[2] == "finish":
    latch.finish()
    time.sleep(float(sys.argv[1]) + 0.5)
    print("finished", flush=True)
else:
    time.sleep(60)  # a step that does not end: the watchdog must
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("mode", ["finish", "hang"])
def test_sigterm_is_latched_and_the_grace_period_ends_a_step_that_does_not_finish(mode):
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1.0", mode], capture_output=True, text=True, timeout=60)
    assert "stop True" in out.stdout, out.stderr
    if mode == "finish":
        assert out.returncode == 0 and "finished" in out.stdout, out.stderr
    else:
        assert out.returncode == 1 and "not reached" not in out.stdout
        assert "grace period of 1s ran out" in out.stderr
        assert time.monotonic() - started < 30
