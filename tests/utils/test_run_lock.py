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


def _slurm_holder(path, job, restarts):
    """The record a run of Slurm job ``job`` (restart ``restarts``) on another host leaves, refreshed just now."""
    path.write_text(
        json.dumps(
            {"host": "node-3", "pid": 77, "started": "earlier", "slurm_job_id": job, "slurm_restart_count": restarts}
        )
    )


def test_a_requeued_slurm_job_takes_its_own_lock_over_at_once(tmp_path, caplog, monkeypatch):
    """The job requeued onto another host after its first host died: the same SLURM_JOB_ID with a higher
    SLURM_RESTART_COUNT takes over the record its earlier run left at once (not after the 300 s bound); the same
    restart count, or another job still listed by Slurm, still counts as running."""
    _slurm_holder(tmp_path / LOCK_FILE, "4242", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands here
    with pytest.raises(ValueError, match="in use by another run"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"), RunLock(tmp_path) as lock:
        record = json.loads(lock.path.read_text())
        assert record["slurm_job_id"] == "4242" and record["slurm_restart_count"] == 1
    assert "at once: this is its Slurm job 4242 requeued (restart 1, the holder's was 0)" in caplog.text


@pytest.mark.parametrize("listed", [False, True])
def test_a_holder_whose_slurm_job_ended_is_taken_over_at_once(tmp_path, caplog, monkeypatch, listed):
    """A record of Slurm job 17 from another host, refreshed just now: taken over at once when ``squeue -h -j 17``
    lists nothing, refused while it lists the job. ``squeue`` here is a stand-in script on PATH (no Slurm on this
    machine; tests/cluster runs the real one)."""
    _slurm_holder(tmp_path / LOCK_FILE, "17", 0)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text("#!/bin/sh\n" + ('echo "  17 batch train u R 1:00 1 node-3"\n' if listed else "exit 0\n"))
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if listed:
        with pytest.raises(ValueError, match="in use by another run"):
            RunLock(tmp_path).acquire()
        return
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"), RunLock(tmp_path):
        pass
    assert "at once: its Slurm job 17 has ended (squeue lists nothing)" in caplog.text
