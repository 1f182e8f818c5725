"""megatron_pacs/rollout/fleet/ray_start.py: a local Ray whose node does not register within Ray's fixed 30 s is
started again, and what its first start left is ended; a Ray Client connection whose server died at its start fails
at once (not after the head's 30-40 s hold) and is made again."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from launch_queue import run_launch

from megatron_pacs.utils.launch import free_port

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


def prepare(root: Path) -> Path:
    return root


def _unregistered(root: Path) -> subprocess.CompletedProcess:
    """The probe, ~50 s of which ~30 s wait out Ray's fixed registration time: a launch (tests/launch_queue.py), so
    the wait is not on the in-process tests' path."""
    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    try:
        return run_launch([sys.executable, "-c", PROBE, temp], timeout=240)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


LAUNCHES = {"unregistered": _unregistered}
#: it waits out Ray's 30 s registration wait, outside the launch slots, once the queue is in the foreground: at the
#: session's start, beside the cluster tests, Slurm's jobs and three background launches, the second, unstopped
#: raylet missed the 30 s too (a clean-clone run, 2026-11-29: attempt 3 of 3 started)
LIGHT_LAUNCHES = frozenset(LAUNCHES)


@pytest.mark.slow
def test_a_local_ray_node_that_does_not_register_in_time_is_ended_and_started_again(launched):
    proc = launched["unregistered"].result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["stopped"]) == 1 and not result["first_raylet_alive"], result
    assert result["worker"] > 0
    assert proc.stderr.count("did not register within Ray's fixed 30 s") == 1, proc.stderr[-4000:]
    assert "attempt 2 of 3" in proc.stderr


def test_ray_client_connect_is_retried_when_the_heads_client_server_dies_at_start_simulated(monkeypatch):
    """Simulated Ray Client failures (both messages of ray-project/ray#63202; the real head's failure is forced in the
    test below): the connection is tried again, at most CLIENT_ATTEMPTS times, and only for those failures; anything
    else is raised at once."""
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
    failures[:] = [zombie] * ray_start.CLIENT_ATTEMPTS
    with pytest.raises(ConnectionAbortedError, match="Initialization failure"):
        ray_start.join_cluster("ray://head:10001")
    assert len(calls) == ray_start.CLIENT_ATTEMPTS
    calls.clear()
    failures[:] = [ConnectionRefusedError("head:10001 refused")]
    with pytest.raises(ConnectionRefusedError):
        ray_start.join_cluster("ray://head:10001")
    assert len(calls) == 1


# On the head (its PYTHONPATH): while the marker file exists, Ray Client's proxy finds every per-client server it
# starts already dead, as one that lost ray-project/ray#63202's race at its fork (a quarter of back-to-back
# connections, measured here). The proxy's own code then runs unchanged: its failure answer, and the hold of the
# session's streams for the client's reconnect grace.
DEAD_AT_START = """
import os
MARKER = os.environ.get("DEAD_AT_START_MARKER", "")
with open("/proc/self/cmdline", "rb") as f:
    PROXY = b"--mode=proxy" in f.read()
if MARKER and PROXY:
    from ray.util.client.server import proxier

    start = proxier.start_ray_client_server

    def dead_at_start(*args, **kwargs):
        proc = start(*args, **kwargs)
        if os.path.exists(MARKER):
            proc.process.kill()
            proc.process.wait()  # gone before the proxy looks (left a zombie, another of its threads may reap it)
        return proc

    proxier.start_ray_client_server = dead_at_start
"""

CLIENT = r"""
import json, sys, threading, time
import ray
from megatron_pacs.rollout.fleet.ray_start import client_init, join_cluster

address, marker = sys.argv[1:]
started = time.monotonic()
try:
    client_init(address)
    failure = None
except (RuntimeError, ConnectionError) as exc:
    failure = str(exc)
failed_in = time.monotonic() - started
threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
Path = __import__("pathlib").Path
Path(marker).unlink()
# The same process connects once the head's servers start again, as the fleet does: through join_cluster, whose
# retries cover Ray's own race (a per-client server that dies at its start, unforced: 1 in 4 measured), which once
# failed this second connection in a full run.
# --ray-runtime-env: the job's runtime_env reaches the cluster's workers through Ray Client.
join_cluster(address, {"env_vars": {"MP_PROBE": "42"}})
answer = ray.get(ray.remote(lambda: int(__import__("os").environ["MP_PROBE"])).remote(), timeout=60)
ray.shutdown()
print(json.dumps({"failure": failure, "failed_in": failed_in, "threads": threads, "answer": answer}))
"""


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _stop_head(head: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group already gone
        os.killpg(head.pid, signal.SIGKILL)  # a throwaway head: its graceful stop takes 30 s
    head.wait(timeout=30)


def _start_head(env: dict[str, str], temp: Path, log: Path, attempts: int = 3) -> tuple[subprocess.Popen, int]:
    """``ray start --head --block`` on free ports, its output appended to ``log``; returns it and its client port once
    the port answers. A start that ends first (Ray waits a fixed 30 s for its raylet to register, too short on a
    loaded 2-core machine; or a port taken between its choice and its use) is started again on new ports,
    ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        gcs, client, agent = free_port(), free_port(), free_port()
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address"]
        cmd += ["127.0.0.1", "--port", str(gcs), "--ray-client-server-port", str(client)]
        cmd += ["--dashboard-agent-listen-port", str(agent), "--num-cpus", "1", "--include-dashboard=false"]
        cmd += ["--temp-dir", str(temp), "--object-store-memory", str(2**27)]
        with log.open("a") as out:
            out.write(f"--- attempt {attempt} of {attempts}\n")
            out.flush()
            head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while head.poll() is None and time.monotonic() < deadline and not _port_open(client):
            time.sleep(0.2)
        if head.poll() is None and _port_open(client):
            return head, client
        _stop_head(head)
    raise AssertionError(f"the Ray head did not start in {attempts} attempts:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_a_client_server_that_dies_at_its_start_fails_the_connection_at_once_and_the_next_one_connects(tmp_path):
    """A real Ray head whose per-client servers are dead at their start (forced: the race is intermittent): the
    head answers the connection with its failure at once but holds the session's streams for
    the client's reconnect grace (30 s here, Ray's default) and its log stream's retries; client_init raises within
    seconds, leaves no stream thread behind, and the same process then connects (``join_cluster``, as the fleet
    does) and runs a task, which sees the job's ``runtime_env`` (``--ray-runtime-env``)."""
    from megatron_pacs.rollout.fleet.ray_start import CLIENT_SERVER_START_FAILURES

    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # Ray's socket paths must stay under 107 characters
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DEAD_AT_START)
    marker = tmp_path / "dead-at-start"
    marker.touch()
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    head_env = {**env, "PYTHONPATH": str(site), "DEAD_AT_START_MARKER": str(marker)}
    head_log = tmp_path / "head.log"
    head, client = _start_head(head_env, temp, head_log)
    try:
        client_env = {**env, "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "30"}
        proc = subprocess.run(
            [sys.executable, "-c", CLIENT, f"ray://127.0.0.1:{client}", str(marker)],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        head_exit = head.poll()  # None: still up, as it should be (ray start --block ends with its cluster)
        _stop_head(head)
        shutil.rmtree(temp, ignore_errors=True)
    head_text = f"\nhead exited {head_exit}; its output:\n{head_log.read_text(errors='replace')[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-4000:] + head_text
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Both of the race's messages come from the same failure path of the proxy; which one depends on when it looks.
    assert any(m in result["failure"] for m in CLIENT_SERVER_START_FAILURES), result
    assert result["failed_in"] < 15, result  # the head holds the streams for 30 s (40 with the log stream's retries)
    assert result["threads"] == [], result
    assert result["answer"] == 42
