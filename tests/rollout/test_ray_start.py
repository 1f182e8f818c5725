"""megatron_pacs/rollout/fleet/ray_start.py: a local Ray whose node does not register within Ray's fixed 30 s is
started again, and what its first start left is ended."""

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.waits]

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
