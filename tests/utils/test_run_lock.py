"""One run per --save: the lock refuses a second holder naming the first, takes over from a holder that
is gone (this host: no process holds the flock; another host: a record not refreshed for the bound), and is released
at exit."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_pacs.utils.run_lock import LOCK_FILE, RunLock


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with RunLock(tmp_path / "ckpt") as first:
        with pytest.raises(ValueError) as caught:
            RunLock(tmp_path / "ckpt").acquire()
        message = str(caught.value)
        assert message.startswith(f"--save: {tmp_path / 'ckpt'} is in use by another run")
        assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in message and "\n" not in message
        record = json.loads(first.path.read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert (tmp_path / "ckpt" / LOCK_FILE).read_text() == ""  # released: the record emptied, the file kept
    with RunLock(tmp_path / "ckpt"):  # and free again
        pass


def test_a_holder_that_died_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    """A run killed with SIGKILL leaves its record; the kernel dropped its flock, so the next run takes over."""
    lock = f"RunLock({str(tmp_path)!r}).acquire()"
    script = f"import os; from megatron_pacs.utils.run_lock import RunLock; {lock}; os._exit(9)"
    subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    dead = json.loads((tmp_path / LOCK_FILE).read_text())["pid"]
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"), RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert f"pid {dead}" in caplog.text and "taking over" in caplog.text


def test_another_hosts_record_counts_until_it_goes_stale(tmp_path, caplog):
    """On a shared filesystem the flock of another host may be invisible: its record's refresh time decides."""
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "earlier"}))
    with pytest.raises(ValueError, match=r"in use by another run \(host node-17, pid 4242, started earlier\)"):
        RunLock(tmp_path, stale_after_s=600).acquire()
    old = time.time() - 700
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"), RunLock(tmp_path, stale_after_s=600):
        pass
    assert "host node-17, pid 4242" in caplog.text and "silent for" in caplog.text


def test_the_holder_refreshes_its_record(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05) as lock:
        old = time.time() - 100
        os.utime(lock.path, (old, old))
        time.sleep(0.3)
        assert time.time() - lock.path.stat().st_mtime < 5
