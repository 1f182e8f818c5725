"""A fork server for the suite's Python launches: torch, Megatron-Core, transformers and the trainer imported once.

A trainer launch of the suite is a tiny run whose process spends most of its CPU importing torch, Megatron-Core,
mbridge and transformers (~4 of its ~6 CPU-s; a torchrun of two ranks pays it three times). Here one server process
per environment imports them once, then forks a child for each launch that runs ``python [-u] [-B] -m MODULE ...``
or ``python [-u] [-B] SCRIPT ...`` as the interpreter would: ``sys.argv``, ``sys.path``, the environment, the
working folder, standard streams (the caller's file descriptors, passed over the socket), a session of its own, the
default signal handlers, and Python's exit (non-daemon threads joined, ``atexit`` run, the exit status or signal).
Everything the child does after that is the real program: Megatron, Ray, vLLM and the reward pool start as they
always do (Ray's and multiprocessing's processes are started from the real interpreter).

What a forked child cannot differ in from its server is what the preloaded libraries read when they load: OpenMP's
and MKL's thread and ISA settings, torch's kernel pins, Hugging Face's cache paths, and so on. So a launch is
served only when its environment equals the server's outside :data:`RUNTIME_ONLY` (variables read at run time:
torchrun's rank variables, pytest's current test, this module's own); a launch with any other difference gets a
server of its own environment (started at that environment's second launch: the first runs as a plain
subprocess), and a command line this module does not parse (``-X``, ``-c``, other flags) runs as a plain
subprocess. Servers start without ``PYTHONPATH``; a launch's ``PYTHONPATH`` may name folders that hold only a
``sitecustomize.py`` (tests/no_fleet_stack): they are put on ``sys.path`` where the interpreter puts them and the
``sitecustomize`` is run, as at start-up; a folder with anything else makes the launch a plain subprocess.

A served launch gets ``PYTHON_EXEC`` set to this server's client (:func:`client_path`, a small stdlib script run by
the base interpreter with ``-I -S``): what it starts through that variable is forked by the server as well (torchrun's
ranks, and a tool's local ranks, megatron_pacs/utils/launch.py), and the client relays signals to its child and
exits with the child's status.

What differs from a real interpreter, knowingly:

- every child of one server shares its string-hash seed (one ``PYTHONHASHSEED`` per server, not per process);
- what the preloaded libraries print while they load (Megatron-Core's notices that Transformer Engine and Apex are
  absent) is in the server's log, not in each child's standard error.

A second kind of server, ``engine`` (:func:`engine_runtime_env`), forks the Ray workers of the pytest process's
own fleets with vLLM imported: Ray runs each worker as ``py_executable default_worker.py ...`` and the job's
``py_executable`` is this module's client.

``MEGATRON_PACS_ZYGOTE=0`` turns it off (every launch a plain subprocess, every engine the real interpreter).
``ZYGOTE_KEEP_LOGS=1`` keeps the servers' folder in /tmp: each server's log (why another server, what it forked)
and ``plain.log`` (why a launch it could have served ran as a plain subprocess).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from zygote_ray_hook import HOOK
from zygote_server import _THREADED, RUNTIME_ONLY, _extra_path, _profile, _recv, _send, parse_command

__all__ = [
    "RUNTIME_ONLY",
    "ZygotePopen",
    "client_path",
    "enabled",
    "engine_runtime_env",
    "forks",
    "off_reason",
    "popen",
    "recipe_env",
    "run",
    "runtime_env_flag",
    "served_children",
    "shutdown",
]

_SOCKET_ENV = "ZYGOTE_SOCKET"
_START_TIMEOUT_S = 300.0  # a server's imports: ~4-8 CPU-s; minutes on a loaded 2-core machine
_ENABLED_ENV = "MEGATRON_PACS_ZYGOTE"
_HERE = Path(__file__).resolve().parent


def enabled() -> bool:
    """Launches go through the fork servers (``MEGATRON_PACS_ZYGOTE=0``: plain subprocesses)."""
    return os.environ.get(_ENABLED_ENV, "1") != "0" and sys.platform == "linux"


def off_reason() -> str | None:
    """Why the fork servers serve nothing in this session (then every launch is a plain subprocess, every engine
    starts its own interpreter, and the suite takes about 1.5 times as long), or None where they serve."""
    if not enabled():
        return f"{_ENABLED_ENV}=0"
    if _extra_path(dict(os.environ)) is None:
        return (
            f"PYTHONPATH={os.environ.get('PYTHONPATH')} names a folder that holds more than a sitecustomize.py (what "
            "the fork servers preloaded could differ), so they serve nothing"
        )
    return None


# -- the client side -------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_CLIENT_LOCK = threading.Lock()
_SERVERS: dict[str, tuple[subprocess.Popen, str, dict[str, str]]] = {}  # profile hash -> (process, socket, env)
_ROOT: str | None = None
_UNSERVABLE: set[str] = set()  # profiles whose imports start a thread
_REQUESTS: dict[str, int] = {}  # profile -> launches asked for


def _root() -> str:
    global _ROOT
    if _ROOT is None:
        _ROOT = tempfile.mkdtemp(prefix="zygote_", dir="/tmp")  # short: Unix socket paths are 107 bytes at most
        atexit.register(shutdown)
    return _ROOT


def client_path() -> str:
    """An executable that runs ``python ARGS`` through the fork server named by ``$ZYGOTE_SOCKET``."""
    path = Path(_root()) / "python"
    with _CLIENT_LOCK:
        if path.exists():
            return str(path)
        base = getattr(sys, "_base_executable", sys.executable)
        source = (_HERE / "zygote_client.py").read_text()
        line = 'REAL_PYTHON = os.environ.get("ZYGOTE_REAL_PYTHON", "")'
        assert line in source
        tests = "TESTS_DIR = os.path.dirname(os.path.abspath(__file__))"
        assert tests in source
        source = source.replace(line, f"REAL_PYTHON = {sys.executable!r}").replace(tests, f"TESTS_DIR = {str(_HERE)!r}")
        text = f"#!{base} -IS\n" + source
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.rename(path)
    return str(path)


def _server_for(
    env: dict[str, str], *, at_request: int = 1, kind: str = "python", wait: bool = True
) -> tuple[str, dict[str, str]] | None:
    """The socket of the server for ``env``'s profile, started (and waited for) at the profile's ``at_request``-th
    request; None before that, and where no server can serve it (its imports started a thread: then every launch
    of that environment is a plain subprocess).

    Args:
        env: The launch's environment.
        at_request: A server costs one launch's imports: :func:`popen` starts one at a profile's second launch, so
            an environment used once (a test's own variables) costs nothing more than a plain subprocess.
        kind: ``python`` (:data:`PRELOAD`) or ``engine`` (:data:`ENGINE_PRELOAD`).
        wait: Whether to wait for a new server's imports; without, its socket is returned at once (a client that
            finds no socket yet runs the real interpreter).
    """
    profile = _profile(env, kind)
    key = kind[0] + hashlib.sha256(json.dumps(sorted(profile.items())).encode()).hexdigest()[:15]
    with _LOCK:
        if key in _UNSERVABLE:
            return None
        _REQUESTS[key] = _REQUESTS.get(key, 0) + 1
        if key not in _SERVERS and _REQUESTS[key] < at_request:
            return None
        if key not in _SERVERS:
            folder = Path(_root()) / key
            folder.mkdir()
            sock = str(folder / "s")
            server_env = dict(profile)
            (folder / "profile.json").write_text(json.dumps(profile, indent=0, sort_keys=True))
            log = open(folder / "log", "w")
            if _SERVERS:  # why another server: what differs from the first one's environment
                first = _profile(next(iter(_SERVERS.values()))[2], kind)
                differs = sorted(k for k in first.keys() | profile.keys() if first.get(k) != profile.get(k))
                log.write(f"another server: the environment differs from the first server's in {differs}\n")
                log.flush()
            proc = subprocess.Popen(
                [sys.executable, str(_HERE / "zygote_server.py"), sock, kind],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=server_env,
                start_new_session=True,
            )
            assert proc.stdout is not None
            if not wait:
                _SERVERS[key] = (proc, sock, server_env)
                return sock, server_env
            # after its imports; bounded: a server that hangs in them serves nothing, its launches run as before
            ready = select.select([proc.stdout], [], [], _START_TIMEOUT_S)[0]
            line = proc.stdout.readline() if ready else ""
            if line.strip() != "ready":
                proc.kill()
                proc.wait()
                if not ready:
                    log.write(f"not ready within {_START_TIMEOUT_S:.0f} s: killed; plain processes for its launches\n")
                log.close()
                text = (folder / "log").read_text()
                if _THREADED in text or not ready:
                    _UNSERVABLE.add(key)
                    return None
                raise RuntimeError(f"the fork server did not start: {text[-3000:]}")
            _SERVERS[key] = (proc, sock, server_env)
        _, sock, server_env = _SERVERS[key]
    return sock, server_env


def recipe_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a recipe (examples/*.sh) that runs ``$PYTHON``: its launcher and its ranks forked by the server of
    ``env``'s environment (started here, and waited for), inside the client's namespaces where it runs on a
    virtual cluster's host. Unchanged where the servers are off.

    Args:
        env: The recipe's whole environment (the recipes' own variables, :data:`RUNTIME_ONLY`, may differ later).
    """
    if not enabled():
        return env
    server = _server_for(env)  # waited for: the recipe's processes start at once
    if server is None:
        return env
    client = client_path()
    return {**env, "PYTHON": client, "PYTHON_EXEC": client, _SOCKET_ENV: server[0]}


def engine_runtime_env(driver_env: dict[str, str], *, wait: bool = False) -> dict[str, Any] | None:
    """A Ray job's ``runtime_env`` whose engine actors are forked by an engine server (:data:`ENGINE_PRELOAD`
    imported), for workers whose environment is ``driver_env`` (a local Ray's driver's, or a Ray cluster's ``ray
    start``'s: the virtual cluster's rollout hosts pass it as ``--ray-runtime-env``, and the server forks each
    engine in its client's network and mount namespaces). Ray starts each worker as ``py_executable
    default_worker.py ...``; the client (:func:`client_path`) asks the server, and runs the real interpreter where the
    server refuses (another environment: Ray's other workers) or is not up yet (it is started here, in the
    background unless ``wait``). None where the fork servers are off."""
    if not enabled():
        return None
    sock = _engine_socket(driver_env, wait=wait)
    return None if sock is None else {"py_executable": client_path(), "env_vars": {_SOCKET_ENV: sock}}


def runtime_env_flag(env: dict[str, str]) -> list[str]:
    """``--ray-runtime-env`` for a trainer whose Ray cluster's workers have the environment ``env`` (a rollout
    host's ``ray start``'s): its engines forked by an engine server of ``env`` (waited for); none where the fork
    servers are off."""
    runtime_env = engine_runtime_env(env, wait=True)
    return [] if runtime_env is None else ["--ray-runtime-env", json.dumps(runtime_env)]


def _engine_socket(driver_env: dict[str, str], *, wait: bool = False) -> str | None:
    """The socket of the engine server for the engine actors of a driver whose environment is ``driver_env``: theirs
    is the driver's plus the backend's ``actor_env`` (which reads the driver's vLLM log level), plus ``SPT_NOENV``,
    which the raylet sets for every worker it starts (setproctitle, which the preloaded libraries import, reads it).
    ``wait``: for the server's imports."""
    from megatron_pacs.rollout.vllm_backend.engine import VLLMEngine

    level = driver_env.get("VLLM_LOGGING_LEVEL", "WARNING")
    actor = {**VLLMEngine.actor_env(on_gpu=False), "VLLM_LOGGING_LEVEL": level}
    server = _server_for({**driver_env, **actor, "SPT_NOENV": "1"}, kind="engine", wait=wait)
    return None if server is None else server[0]


def _launch_engines(env: dict[str, str]) -> dict[str, str]:
    """What a launch forked by a python server gets in its environment so that the engine actors of its own local
    Ray are forked by an engine server too (tests/zygote_ray_hook.py). The server is waited for (once per
    environment, in a launch thread): every launch then forks its engines, whatever the load."""
    sock = _engine_socket(env, wait=True)
    if sock is None:
        return {}
    return {"RAY_RUNTIME_ENV_HOOK": HOOK, "ZYGOTE_CLIENT": client_path(), "ZYGOTE_ENGINE_SOCKET": sock}


#: The suite's scripts that start a real fleet (a ``Trainer`` with its engines on a local Ray).
_FLEET_SCRIPTS = frozenset({"trainer_checks.py", "trainer_fault_checks.py"})


def _starts_engines(command: dict) -> bool:
    """Whether a launch may start a fleet: ``megatron_pacs.train`` (under torchrun too) or one of
    :data:`_FLEET_SCRIPTS`, not a synthetic source, a help or a dry run."""
    args = command["args"]
    trains = (
        command.get("module") == "megatron_pacs.train"
        or (command.get("module") == "torch.distributed.run" and "megatron_pacs.train" in args)
        or Path(command.get("script") or "").name in _FLEET_SCRIPTS
    )
    synthetic = any(a == "--rollout-source" and b == "synthetic" for a, b in itertools.pairwise(args))
    never = {"--rollout-source=synthetic", "--help", "-h", "--dry-run"}
    return trains and not synthetic and not never & set(args)


def shutdown() -> None:
    """End every server (their socket folders removed: each server's loop ends, then the process is killed)."""
    with _LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for proc, sock, _ in servers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if _ROOT is not None and os.environ.get("ZYGOTE_KEEP_LOGS", "0") == "0":
        import shutil

        shutil.rmtree(_ROOT, ignore_errors=True)


def forks(kind: str = "engine") -> list[tuple[dict[str, str], str]]:
    """What the servers of ``kind`` forked so far: (the server's environment, the program) per child."""
    if _ROOT is None:
        return []
    out = []
    for folder in sorted(Path(_ROOT).glob(f"{kind[0]}*/")):
        with contextlib.suppress(OSError, ValueError):
            profile = json.loads((folder / "profile.json").read_text())
            lines = (folder / "log").read_text(errors="replace").splitlines()
            out += [(profile, line.split(": ", 1)[1]) for line in lines if line.startswith("forked ")]
    return out


def served_children() -> dict[int, int]:
    """Each running child of a server started for a client process (torchrun's ranks): child pid -> client pid."""
    if _ROOT is None:
        return {}
    out = {}
    for edge in Path(_ROOT).glob("*/edges/*"):
        with contextlib.suppress(OSError, ValueError):
            out[int(edge.name)] = int(edge.read_text())
    return out


class _Refused(RuntimeError):
    """The server would not run the request (its reason)."""


class ZygotePopen:
    """A forked child of a fork server, as much of :class:`subprocess.Popen` as the suite uses."""

    def __init__(self, args: list[str], sock_path: str, request: dict, *, text: bool) -> None:
        self.args = args
        self.returncode: int | None = None
        self._text = text
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(sock_path)
            _send(self._conn, request, [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        reply, _ = _recv(self._conn)
        if reply is None or "pid" not in reply:
            self._conn.close()
            os.close(out_r)
            os.close(err_r)
            raise _Refused(reply.get("refused", "") if reply else "the fork server closed the connection")
        self.pid: int = reply["pid"]
        self.stdout = open(out_r, encoding="utf-8", errors="replace") if text else open(out_r, "rb")
        self.stderr = open(err_r, encoding="utf-8", errors="replace") if text else open(err_r, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                reply, _ = _recv(self._conn)
            except BlockingIOError:
                return None
            finally:
                with contextlib.suppress(OSError):
                    self._conn.setblocking(True)
            self._status(reply)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                reply, _ = _recv(self._conn)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._status(reply)
        assert self.returncode is not None
        return self.returncode

    def _status(self, reply: dict | None) -> None:
        if reply is None:  # the server is gone
            self.returncode = -signal.SIGKILL
        else:
            status = reply["status"]
            self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self._conn.close()

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Both streams read to their end and the exit waited for, within ``timeout`` seconds together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[str, Any] = {}

        def read(name: str, stream: Any) -> None:
            chunks[name] = stream.read()

        readers = [
            threading.Thread(target=read, args=(n, s), daemon=True)
            for n, s in (("out", self.stdout), ("err", self.stderr))
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.01, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return chunks["out"], chunks["err"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    text: bool = True,
    nice: int | None = None,
    **kwargs: Any,
) -> ZygotePopen | subprocess.Popen:
    """``subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, start_new_session=True, ...)``, forked by a fork server
    where ``cmd`` is ``sys.executable`` with a command line it runs (:func:`parse_command`); a plain subprocess
    otherwise. ``nice``: the child's autogroup nice (it is in a session of its own either way)."""
    env = dict(os.environ if env is None else env)

    def plain(why: str) -> subprocess.Popen:
        if os.environ.get("ZYGOTE_KEEP_LOGS", "0") != "0":  # kept with the servers' logs: why a launch ran plain
            with _LOCK, open(Path(_root()) / "plain.log", "a") as log:
                log.write(f"{why}: {' '.join(map(str, cmd))[:300]}\n")
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text, env=env, cwd=cwd, start_new_session=True
        )

    command = parse_command(cmd[1:]) if cmd and cmd[0] == sys.executable else None
    if not enabled() or command is None or kwargs:
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=text,
            env=env,
            cwd=cwd,
            start_new_session=True,
            **kwargs,
        )
    if _extra_path(env) is None:
        return plain("a PYTHONPATH folder with more than a sitecustomize.py")
    server = _server_for(env, at_request=2)
    if server is None:
        return plain("no server for its environment (yet)")
    served = {**env, **_launch_engines(env)} if _starts_engines(command) else dict(env)
    # what it starts through PYTHON_EXEC (torchrun's ranks, a tool's local ranks) is forked by the same server
    served.update(PYTHON_EXEC=client_path(), **{_SOCKET_ENV: server[0]})
    request = {
        "command": command,
        "env": served,
        "cwd": str(Path(cwd).resolve()) if cwd is not None else os.getcwd(),
        "executable": sys.executable,
        "nice": nice,
        "client_pid": None,
    }
    try:
        return ZygotePopen(cmd, server[0], request, text=text)
    except _Refused:  # a plain one has the caller's environment, not the client's for torchrun's ranks
        return plain("refused by its server")


def run(
    cmd: list[str],
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)`` through
    :func:`popen`; on a time-out the child's session is killed."""
    proc = popen(cmd, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode is not None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
