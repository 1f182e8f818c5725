"""The session's launch queue (tests/launch_queue.py): priority and concurrency in the background and foreground,
and a close that ends the launches still running."""

import sys
import threading
import time
from pathlib import Path

import pytest
from launch_queue import BACKGROUND_NICE, BACKGROUND_SLOTS, LaunchQueue, run_launch

AUTOGROUP = Path("/proc/self/autogroup")
pytestmark = pytest.mark.skipif(not AUTOGROUP.exists(), reason="this kernel has no autogroups")

# prints its autogroup ("/autogroup-N nice K") after a while, so launches overlap where allowed
SHOW = [sys.executable, "-c", "import time; time.sleep(0.5); print(open('/proc/self/autogroup').read().strip())"]


def _nice(line: str) -> int:
    return int(line.rsplit(" ", 1)[1])


def _queue(tmp_path: Path, launches: dict, background: bool, light: frozenset[str] = frozenset()) -> LaunchQueue:
    queue = LaunchQueue(workers=2)
    queue.background(background)
    queue.plan("m", lambda root: root, launches, tmp_path, light)
    return queue


def _timed(_root: Path) -> tuple[float, float, str]:
    started = time.monotonic()
    out = run_launch(SHOW, timeout=60).stdout
    return started, time.monotonic(), out


def _most_at_once(spans: list[tuple[float, float, str]]) -> int:
    return max(sum(s0 <= t < s1 for s0, s1, _ in spans) for t, _, _ in spans)


def test_background_runs_its_slots_at_a_low_priority_foreground_two_at_normal(tmp_path):
    launches = {name: _timed for name in "abcdefgh"[: BACKGROUND_SLOTS + 1]}
    queue = _queue(tmp_path, launches, background=True)
    try:
        spans = [f.result(timeout=60) for f in queue.futures("m").values()]
    finally:
        queue.close()
    assert {_nice(out) for _, _, out in spans} == {BACKGROUND_NICE}, spans
    assert _most_at_once(spans) == BACKGROUND_SLOTS, spans  # one launch more than the slots: never all at once
    # pytest's own group is untouched (each launch has its own session); it reads empty where pytest runs in the
    # root group (no session of its own, as under CI's runner)
    own = AUTOGROUP.read_text()
    assert not own or _nice(own) == 0, own

    queue = _queue(tmp_path, {"a": _timed, "b": _timed, "c": _timed}, background=False)
    try:
        (a0, a1, a), (b0, b1, b), (c0, _, _) = (f.result(timeout=60) for f in queue.futures("m").values())
    finally:
        queue.close()
    assert _nice(a) == _nice(b) == 0, (a, b)
    assert b0 < a1 and a0 < b1, "the foreground ran its two launches one after the other"
    assert c0 >= min(a1, b1), "a third launch started in the foreground's two slots"


def test_a_light_launch_waits_for_the_foreground_then_runs_beside_full_slots(tmp_path):
    """``LIGHT_LAUNCHES`` (a launch that waits out a timeout) takes no slot: queued after the slots are full, it
    runs beside them; in the background it waits for the foreground. A name not among the launches is refused."""
    launches = {"a": _timed, "b": _timed, "wait": _timed}
    queue = _queue(tmp_path, launches, background=True, light=frozenset({"wait"}))
    try:
        time.sleep(2)  # the background's slots ran a and b; the light one waited
        assert not queue.futures("m")["wait"].done()
        queue.background(False)
        spans = {name: f.result(timeout=60) for name, f in queue.futures("m").items()}
    finally:
        queue.close()
    assert spans["wait"][0] >= max(spans["a"][0], spans["b"][0]), spans
    assert _nice(spans["wait"][2]) == 0, spans
    queue = _queue(tmp_path, launches, background=False, light=frozenset({"wait"}))
    try:
        spans = [f.result(timeout=60) for f in queue.futures("m").values()]
    finally:
        queue.close()
    assert _most_at_once(spans) == 3, spans
    queue = LaunchQueue(workers=2)
    try:
        with pytest.raises(ValueError, match=r"light launches \['nope'\]"):
            queue.plan("m", lambda root: root, launches, tmp_path, frozenset({"nope"}))
    finally:
        queue.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _child_pid(proc) -> int | None:
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    pids = children.read_text().split() if children.exists() else []
    return int(pids[0]) if pids else None


def test_a_launch_running_in_the_background_comes_to_the_foreground_and_close_ends_what_still_runs(tmp_path):
    """Its child in a session of its own (as torchrun starts its workers) gets the launch's priority too."""
    ready = threading.Event()
    # a child in its own session (an autogroup of its own), then a long wait
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "time.sleep(600)"
    )

    def long(_root: Path):
        ready.set()
        return run_launch([sys.executable, "-c", script], timeout=600)

    queue = _queue(tmp_path, {"long": long}, background=True)
    try:
        future = queue.futures("m")["long"]
        assert ready.wait(30)
        deadline = time.monotonic() + 30
        while not queue._live and time.monotonic() < deadline:
            time.sleep(0.05)
        (proc,) = queue._live
        group = Path(f"/proc/{proc.pid}/autogroup")
        assert _nice(group.read_text()) == BACKGROUND_NICE
        while (child := _child_pid(proc)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child is not None
        child_group = Path(f"/proc/{child}/autogroup")
        # its own group once it has called setsid (right after the fork it is still in the launch's), then the queue's
        # watch gives that group the launch's nice within a second
        while time.monotonic() < deadline and (
            child_group.read_text() == group.read_text() or _nice(child_group.read_text()) != BACKGROUND_NICE
        ):
            time.sleep(0.1)
        assert child_group.read_text() != group.read_text()  # another group, at the same priority
        assert _nice(child_group.read_text()) == BACKGROUND_NICE
        queue.background(False)
        assert _nice(group.read_text()) == _nice(child_group.read_text()) == 0
    except BaseException:
        queue.close()  # no launch left running behind a failed check (the pool joins its threads at exit)
        raise
    started = time.monotonic()
    queue.close()
    assert time.monotonic() - started < 30
    assert future.result(timeout=5).returncode == -9  # killed by the close, with its process group
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child in its own session outlived the close"


def test_prepare_runs_in_the_planning_thread_and_its_failure_fails_each_launch_of_the_module(tmp_path):
    """Guards the CI failure where a tiny model built by a prepare in a worker thread was saved untied: transformers
    swaps torch's init functions and ``tie_weights`` for no-ops process-wide while the main thread loads a model."""
    threads: list[threading.Thread] = []

    def prepare(root: Path) -> Path:
        threads.append(threading.current_thread())
        return root / "inputs"

    def broken(_root: Path) -> None:
        raise ValueError("no inputs")

    queue = LaunchQueue(workers=2)
    try:
        queue.plan("m", prepare, {"a": lambda inputs: inputs, "b": lambda inputs: inputs.name}, tmp_path)
        assert threads == [threading.current_thread()]  # done before plan returned
        queue.plan("broken", broken, {"c": lambda _: "ran"}, tmp_path)
        a, b = (f.result(timeout=30) for f in queue.futures("m").values())
        assert (a, b) == (tmp_path / "inputs", "inputs")
        with pytest.raises(RuntimeError, match="failed") as failed:
            queue.futures("broken")["c"].result(timeout=30)
        assert isinstance(failed.value.__cause__, ValueError)
    finally:
        queue.close()
    assert threads == [threading.current_thread()]
