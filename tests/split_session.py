"""The early tests (the virtual cluster's, and those marked ``waits``) in a pytest session of their own, beside the
rest of the suite.

They are the suite's longest serial stretch (about half of a run's wall time) and mostly wait on real processes in
network namespaces, a real Slurm and fixed timeouts; the rest of the suite ran after them on the same two cores.
Here the session that collects the suite starts a second pytest for the early tests at once (its own process
session, the normal priority) and runs everything else beside it at a low priority (its autogroup at
:data:`BACKGROUND_NICE`, as the launch queue's background launches have always run beside the cluster tests): the
early tests' timings are still measured on a machine whose spare CPU goes to the rest. When the early session ends,
the rest goes back to the normal priority and the launch queue to two launches at once.

The early session's results join the main session's: each of its tests counts in the final line as passed, failed
or skipped (read from its JUnit XML), its output is printed before the summary, and a failure there fails the run.
It needs root (raising a priority again needs CAP_SYS_NICE); elsewhere, or with ``MEGATRON_PACS_SPLIT=0``, the
early tests run first in the one session, as before.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

__all__ = ["BACKGROUND_NICE", "EarlySession", "split_enabled"]

CHILD_ENV = "MEGATRON_PACS_SPLIT_CHILD"
#: The main session's autogroup nice while the early session runs (the launch queue's background nice).
BACKGROUND_NICE = 10
#: The longest the main session waits for the early one after its own tests (each early test has pytest-timeout's
#: 900 s; the early session takes about 10 minutes on a 2-core machine).
WAIT_S = 3600.0


def split_enabled() -> bool:
    """This session may start an early session: root, not itself one, and not turned off."""
    return (
        os.environ.get(CHILD_ENV) is None
        and os.environ.get("MEGATRON_PACS_SPLIT", "1") != "0"
        and sys.platform == "linux"
        and os.geteuid() == 0
    )


def _set_own_nice(nice: int) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(nice))


class EarlySession:
    """A second pytest running ``nodeids`` (its output in a temporary file) beside this session.

    Args:
        nodeids: The early tests, in the order they run.
        rootdir: Where pytest runs (the checkout).
    """

    def __init__(self, nodeids: list[str], rootdir: Path) -> None:
        self.nodeids = nodeids
        self._dir = Path(tempfile.mkdtemp(prefix="early_session_"))
        self.junit = self._dir / "junit.xml"
        self.log = self._dir / "output.txt"
        self.started = time.monotonic()
        self.seconds: float | None = None
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={self.junit}", *nodeids]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=rootdir,
                env=dict(os.environ, **{CHILD_ENV: "1"}),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # an autogroup of its own: the normal priority while this one is niced
            )
        _set_own_nice(BACKGROUND_NICE)

    def done(self) -> bool:
        """The early session ended (this session then runs at the normal priority again)."""
        if self.proc.poll() is None:
            return False
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
            _set_own_nice(0)
        return True

    def wait(self) -> int:
        """Its exit status, after at most :data:`WAIT_S` more seconds (then it is killed: status -9)."""
        try:
            self.proc.wait(timeout=max(1.0, WAIT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.done()
        return self.proc.returncode

    def stop(self) -> None:
        """End it (this session was interrupted)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, 9)
                self.proc.wait()
        _set_own_nice(0)

    def reports(self) -> list[pytest.TestReport]:
        """One report per early test that ran (its outcome from the JUnit XML; a failure's text as its message)."""
        if not self.junit.is_file():
            return []
        out = []
        for case in ET.parse(self.junit).iter("testcase"):
            outcome, text = "passed", None
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, text = "failed", (child.get("message") or "") + "\n" + (child.text or "")
                elif child.tag == "skipped":
                    outcome, text = "skipped", child.get("message") or ""
            path = case.get("file") or (case.get("classname") or "").replace(".", "/") + ".py"
            nodeid = f"{path}::{case.get('name')}"
            longrepr = None if text is None else (path, 0, text) if outcome == "skipped" else text
            report = pytest.TestReport(
                nodeid,
                (path, None, case.get("name") or ""),
                {},
                outcome,
                longrepr,
                "call",
                duration=float(case.get("time") or 0.0),
            )
            out.append(report)
        return out

    def output(self) -> str:
        """What the early session printed."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""
