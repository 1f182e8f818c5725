"""The suite's fork server (tests/zygote.py): a forked launch behaves as the interpreter would run it.

Guards what the launches rely on: argv, ``sys.path``, the environment, the working folder, standard streams, a
session of its own, Python's exit (``atexit``, the status, Ctrl-C as a SIGINT death), torchrun's ranks forked by the
same server, a dead client's child ended, ``PYTHONPATH``'s ``sitecustomize`` (tests/no_fleet_stack), and the
refusals: a load-time variable that differs gets a server of its own, an unparsed command line a plain subprocess.
Three servers start for the module (~4 CPU-s of imports each), one to see it end with the process that started
it; each child costs milliseconds. The engine server is guarded in tests/rollout/test_fleet.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from helpers.cpu import PINNED_CPU_ENV
from helpers.runs import NO_FLEET_STACK

# slow: it serves the trainer launches, which make test-quick leaves out (~15 s of fork servers and launches)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not zygote.enabled(), reason="MEGATRON_PACS_ZYGOTE=0")]

SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("atexit", flush=True))
print(sys.argv, os.getcwd(), sys.path[0], os.environ.get("RANK"), os.getsid(0) == os.getpid(), "torch" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1:2] == ["--wait"]:
    open(sys.argv[2], "w").close()
    import time
    time.sleep(60)
sys.exit(int(os.environ.get("RANK", "0")))
"""


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """An environment of this module's own (pytest's changes as the suite runs), its server started."""
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env = {**base, **PINNED_CPU_ENV, "ZYGOTE_TEST_PROFILE": "1"}
    assert zygote._server_for(env) is not None
    return env


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "prog" / "main.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_script_runs_forked_as_the_interpreter_would_run_it(env, script, tmp_path):
    child = zygote.popen([sys.executable, "-u", str(script), "a", "b"], env=dict(env, RANK="3"), cwd=tmp_path)
    assert isinstance(child, zygote.ZygotePopen)
    out, err = child.communicate(timeout=60)
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    assert proc.returncode == 3
    argv, cwd, path0, who, own_session, preloaded = proc.stdout.splitlines()[0].rsplit(" ", 5)
    assert argv == f"[{str(script)!r}, 'a', 'b']" and cwd == str(tmp_path) and path0 == str(script.parent)
    assert (who, own_session, preloaded) == ("3", "True", "True")  # a session of its own; torch came preloaded
    assert proc.stdout.splitlines()[-1] == "atexit" and proc.stderr == "to stderr\n"


def test_a_module_runs_as_main_without_a_warning_and_a_runtime_variable_keeps_the_server(env, tmp_path):
    servers = len(zygote._SERVERS)
    proc = zygote.run([sys.executable, "-m", "megatron_pacs.train", "--help"], env=dict(env, RANK="0"), cwd=tmp_path)
    assert proc.returncode == 0 and "usage:" in proc.stdout and proc.stderr == "", proc.stderr
    assert len(zygote._SERVERS) == servers  # RANK is read at run time only: the same server


def test_a_load_time_variable_gets_a_server_of_its_own_at_its_second_launch_and_a_c_command_a_plain_process(
    env, script
):
    other = dict(env, MKL_CBWR="AUTO")
    before = len(zygote._SERVERS)
    first = zygote.popen([sys.executable, str(script)], env=other)
    assert isinstance(first, subprocess.Popen) and first.communicate(timeout=60)[0].startswith("[")
    assert len(zygote._SERVERS) == before  # an environment used once costs no server
    second = zygote.popen([sys.executable, str(script)], env=other)
    assert isinstance(second, zygote.ZygotePopen) and len(zygote._SERVERS) == before + 1
    assert second.communicate(timeout=60)[0].startswith("[") and second.returncode == 0
    plain = zygote.popen([sys.executable, "-c", "print(1)"], env=env)
    assert isinstance(plain, subprocess.Popen) and plain.communicate()[0] == "1\n"


def test_a_server_not_ready_in_time_is_ended_and_its_environment_runs_plain_processes(env, script, monkeypatch):
    """A server's imports are waited for within a bound: one that hangs in them (a loaded machine, a deadlock) is
    killed, and the launches of its environment run as plain subprocesses. Milliseconds: the server is killed at
    once."""
    monkeypatch.setattr(zygote, "_START_TIMEOUT_S", 0.01)
    slow = dict(env, ZYGOTE_TEST_PROFILE="not ready")
    assert zygote._server_for(slow) is None
    child = zygote.popen([sys.executable, str(script)], env=slow)
    assert isinstance(child, subprocess.Popen) and child.communicate(timeout=60)[0].startswith("[")


def test_ctrl_c_ends_a_child_by_sigint_after_its_atexit_and_a_dead_clients_child_is_killed(env, script, tmp_path):
    ready = tmp_path / "ready"
    proc = zygote.popen([sys.executable, str(script), "--wait", str(ready)], env=env)
    assert isinstance(proc, zygote.ZygotePopen)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT and out.splitlines()[-1] == "atexit" and "KeyboardInterrupt" in err

    ready.unlink()
    client = subprocess.Popen(
        [zygote.client_path(), str(script), "--wait", str(ready)],
        env=dict(env, ZYGOTE_SOCKET=zygote._server_for(env)[0]),  # type: ignore[index]
        stdout=subprocess.PIPE,
        text=True,
    )
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = [c for c, parent in zygote.served_children().items() if parent == client.pid]
    client.kill()
    client.wait()
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()  # the server saw its client's end and killed the child


def test_torchrun_ranks_are_forked_by_the_server_and_reduce_over_gloo(env, tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print(dist.get_rank(), t.item(), os.getppid())\n"
        "dist.destroy_process_group()\n"
    )
    from megatron_pacs.utils.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    proc = zygote.run([*cmd, str(rank)], env=env, timeout=120)  # torchrun itself forked: its ranks too
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line.split() for line in proc.stdout.splitlines() if line[:1].isdigit())
    assert [line[:2] for line in lines] == [["0", "3.0"], ["1", "3.0"]]
    servers = {server.pid for server, _, _ in zygote._SERVERS.values()}
    assert {int(line[2]) for line in lines} <= servers  # each rank's parent is a server, not torchrun


def test_pythonpath_sitecustomize_runs_in_the_child(env, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.util\nprint(importlib.util.find_spec('ray') is None)\n")
    no_fleet = dict(env, PYTHONPATH=NO_FLEET_STACK)
    child = zygote.popen([sys.executable, str(probe)], env=no_fleet)
    assert isinstance(child, zygote.ZygotePopen)
    assert child.communicate(timeout=60)[0] == "True\n" and child.returncode == 0
    plain = zygote.popen([sys.executable, str(probe)], env=dict(env, PYTHONPATH=str(tmp_path)))  # probe.py there
    assert isinstance(plain, subprocess.Popen) and plain.communicate(timeout=60)[0] == "False\n"


def test_a_server_ends_when_the_process_that_started_it_dies_without_its_atexit(env):
    """A pytest ended by SIGTERM runs no ``atexit``: its servers once outlived it, each holding its imports."""
    starter = (
        "import json, sys, time; sys.path.insert(0, sys.argv[1]); import zygote; "
        "sock, _ = zygote._server_for(json.loads(sys.argv[2]), wait=False); print(sock, flush=True); time.sleep(600)"
    )
    own = json.dumps(dict(env, ZYGOTE_TEST_PROFILE="orphan"))
    proc = subprocess.Popen(
        [sys.executable, "-c", starter, str(Path(zygote.__file__).parent), own], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        sock = proc.stdout.readline().strip()
        server = Path(sock).parent
        deadline = time.monotonic() + 120
        while not Path(sock).exists() and time.monotonic() < deadline:  # bound after its imports
            time.sleep(0.2)
        assert Path(sock).exists()
        pids = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).endswith(f"{sock} python")]
        assert len(pids) == 1, pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pids[0]}").exists(), "the server outlived the process that started it"
    shutil.rmtree(server.parent, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_the_launches_ray_hook_names_the_engine_server_and_a_real_interpreter_never_sees_it(env, tmp_path):
    """A served launch's ``RAY_RUNTIME_ENV_HOOK`` (tests/zygote_ray_hook.py) makes its job's workers the client of
    the engine server, leaving a driver's own ``py_executable`` alone; the client, where it runs the real interpreter
    in a server's place, drops the hook (that interpreter could not import it and ``ray.init`` would fail). The
    launches' engines forked: tests/test_objectives_launch.py. Milliseconds (no Ray, no engine server)."""
    import zygote_ray_hook

    served = {"ZYGOTE_ENGINE_SOCKET": "/tmp/s", "ZYGOTE_CLIENT": "/tmp/python"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in served.items():
            mp.setenv(k, v)
        hooked = zygote_ray_hook.forked_engines({"env_vars": {"A": "1"}})
        assert hooked == {"env_vars": {"A": "1", "ZYGOTE_SOCKET": "/tmp/s"}, "py_executable": "/tmp/python"}
        assert zygote_ray_hook.forked_engines(None)["py_executable"] == "/tmp/python"  # type: ignore[index]
        own = {"py_executable": "/usr/bin/python3"}
        assert zygote_ray_hook.forked_engines(own) is own
    assert zygote_ray_hook.forked_engines({"env_vars": {}}) == {"env_vars": {}}  # a launch without the server
    probe = "import os; print(os.environ.get('RAY_RUNTIME_ENV_HOOK'))"
    hooked_env = dict(env, RAY_RUNTIME_ENV_HOOK=zygote_ray_hook.HOOK, ZYGOTE_SOCKET=str(tmp_path / "none"))
    out = subprocess.run(
        [zygote.client_path(), "-c", probe], env=hooked_env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout == "None\n", out.stderr
    assert zygote._starts_engines({"module": "megatron_pacs.train", "args": ["--lr", "1"]})
    assert not zygote._starts_engines({"module": "megatron_pacs.train", "args": ["--rollout-source", "synthetic"]})
    assert zygote._starts_engines({"module": "torch.distributed.run", "args": ["-m", "megatron_pacs.train"]})
    assert not zygote._starts_engines({"script": "check.py", "args": []})


def test_a_child_joins_its_clients_network_and_mount_namespaces(env, tmp_path):
    """A client started by ``ip netns exec`` (a virtual cluster's host, tests/cluster/netns.py) gets its child in
    its network namespace, where ``ip netns pids`` finds it, and in its mount namespace, with the host's own
    ``/etc/hosts``. ~1 s: one namespace, two children of the module's server."""
    ip = shutil.which("ip")
    if ip is None or os.geteuid() != 0:
        pytest.skip("network namespaces need the `ip` command and root")
    ns = f"mpz{os.getpid()}"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, socket, sys\n"
        "print(sorted(n for _, n in socket.if_nameindex()), open('/etc/hosts').read().split(), os.getcwd(),"
        " 'torch' in sys.modules)\n"
    )
    etc = Path("/etc/netns") / ns
    subprocess.run([ip, "netns", "add", ns], check=True, timeout=30)
    try:
        etc.mkdir(parents=True)
        (etc / "hosts").write_text("10.9.9.9 probehost\n")
        recipe = zygote.recipe_env(env)
        assert recipe["PYTHON"] == recipe["PYTHON_EXEC"] == zygote.client_path()
        shell = ["bash", "-c", 'exec "$PYTHON" "$0"', str(probe)]  # as a recipe runs it: SHLVL and _ differ
        out = subprocess.run(
            [ip, "netns", "exec", ns, *shell], env=recipe, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("] ")[0] == "['lo'"  # the namespace's interfaces, not the machine's
        assert "probehost" in out.stdout and str(tmp_path) in out.stdout and out.stdout.strip().endswith("True")
    finally:
        subprocess.run([ip, "netns", "del", ns], timeout=30)
        shutil.rmtree(etc, ignore_errors=True)
