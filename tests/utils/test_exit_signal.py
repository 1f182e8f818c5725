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


@pytest.mark.waits
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


HELPER_SCRIPT = """
import multiprocessing as mp, os, signal, sys, threading
from multiprocessing.managers import SyncManager
from megatron_pacs.utils.exit_signal import ignore_stop_signals, stop_signals_blocked
if __name__ == "__main__":
    os.setpgrp()
    signal.signal(signal.SIGTERM, lambda s, f: print("latched", flush=True))
    # the scheduler's SIGTERM to the whole process group while the helper is still importing
    threading.Timer(0.3, lambda: os.killpg(os.getpgrp(), signal.SIGTERM)).start()
    manager = SyncManager(ctx=mp.get_context("spawn"))
    with stop_signals_blocked():
        manager.start(ignore_stop_signals, (os.getpid(),))
    queue = manager.Queue()
    queue.put(1)
    print("served", queue.get(), manager._process.is_alive(), flush=True)
    manager.shutdown()
"""


def test_a_helper_started_with_stop_signals_blocked_survives_a_sigterm_during_its_start(tmp_path):
    """The checkpoint writer's results server (a spawned SyncManager) started while SIGTERM reaches the process
    group: started inside ``stop_signals_blocked`` it ignores the signal once it can, and serves the queue; the
    caller still latches its own SIGTERM. (Without the block the server died during its imports and the clean
    stop's save failed with ``EOFError``.)"""
    script = tmp_path / "helper.py"
    script.write_text(HELPER_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served 1 True" in out.stdout and "latched" in out.stdout, (out.stdout, out.stderr[-3000:])


CTRL_C_SCRIPT = """
import multiprocessing as mp, os, signal, threading, time
from multiprocessing.managers import SyncManager
from megatron_pacs.utils.exit_signal import ignore_stop_signals, stop_signals_blocked

def start_then_ctrl_c(parent):  # the server, once it ignores the signal: Ctrl-C while the caller awaits its address
    ignore_stop_signals(parent)
    os.killpg(os.getpgid(parent), signal.SIGINT)

if __name__ == "__main__":
    os.setpgrp()
    # Python's own Ctrl-C handler, as train.py installs its own: a suite started in the background by a shell
    # without job control inherits SIGINT ignored, and a process keeps an ignored signal ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread to take the signal
    manager = SyncManager(ctx=mp.get_context("spawn"))
    try:
        with stop_signals_blocked():
            manager.start(start_then_ctrl_c, (os.getpid(),))
            time.sleep(0.5)
            print("started", flush=True)
    except KeyboardInterrupt:
        print("interrupted after the start", flush=True)
"""


def test_a_ctrl_c_during_a_helpers_start_is_raised_after_it_and_the_exit_stops_the_helper(tmp_path):
    """Issue 53's Ctrl-C probe: a Ctrl-C taken by another thread while the checkpoint writer's results server
    started raised inside ``SyncManager.start``, before its stop at the exit was registered; the server ignores
    stop signals, so the rank joined it forever at its exit (the 60 s watchdog ended it). Now the handler runs when
    the block ends: the server is registered, and the interpreter's exit stops it. About 2 s."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["started", "interrupted after the start"], out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
