"""megatron_pacs/rollout/fleet/ray_start.py: a local Ray whose node does not register within Ray's fixed 30 s is
started again, and what its first start left is ended; a Ray Client connection whose server died at its start is
made again."""

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

# Stops (SIGSTOP) the first raylet this process starts, before it registers: Ray's start then times out after its
# fixed 30 s, as on a host too loaded for the raylet to register in time.
PROBE = r"""
import json, os, sys, threading, time
import psutil, ray
from megatron_pacs.rollout.fleet.ray_start import start_local

stopped = []

def stop_first_raylet():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.Process().children():
            try:
                if p.name() == "raylet":
                    p.suspend()
                    stopped.append(p.pid)
                    return
            except psutil.Error:
                pass
        time.sleep(0.01)

threading.Thread(target=stop_first_raylet, daemon=True).start()
start_local(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1], object_store_memory=2**27)

@ray.remote
def pid():
    return os.getpid()

worker = ray.get(pid.remote(), timeout=120)
first = stopped and psutil.pid_exists(stopped[0]) and psutil.Process(stopped[0]).status() != psutil.STATUS_ZOMBIE
print(json.dumps({"stopped": stopped, "first_raylet_alive": bool(first), "worker": worker}))
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.waits
def test_a_local_ray_node_that_does_not_register_in_time_is_ended_and_started_again():
    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE, temp], capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["stopped"]) == 1 and not result["first_raylet_alive"], result
    assert result["worker"] > 0
    assert proc.stderr.count("did not register within Ray's fixed 30 s") == 1, proc.stderr[-4000:]
    assert "attempt 2 of 3" in proc.stderr


def test_ray_client_connect_is_retried_when_the_heads_client_server_dies_at_start_simulated(monkeypatch):
    """Simulated Ray Client failures (ray-project/ray#63202 is an intermittent race on the head, not reproducible on
    demand; the virtual cluster hit both messages): the connection is tried again, at most 3 times, and only for
    those failures; anything else is raised at once."""
    import ray

    from megatron_pacs.rollout.fleet import ray_start

    zombie = ConnectionAbortedError("Initialization failure from server:\npsutil.ZombieProcess: PID still exists")
    failures: list[Exception] = []
    calls: list[str] = []

    def init(address, **kwargs):
        calls.append(address)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_start.time, "sleep", lambda s: None)

    failures[:] = [RuntimeError("Starting Ray client server failed. See ray_client_server_23000.err"), zombie]
    ray_start.join_cluster("ray://head:10001")
    assert calls == ["ray://head:10001"] * 3
    calls.clear()
    failures[:] = [zombie, zombie, zombie]
    with pytest.raises(ConnectionAbortedError, match="Initialization failure"):
        ray_start.join_cluster("ray://head:10001")
    assert len(calls) == 3
    calls.clear()
    failures[:] = [ConnectionRefusedError("head:10001 refused")]
    with pytest.raises(ConnectionRefusedError):
        ray_start.join_cluster("ray://head:10001")
    assert len(calls) == 1
