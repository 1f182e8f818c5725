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

torchrun (``-m torch.distributed.run``) is served too, with ``PYTHON_EXEC`` set to this server's client
(:func:`client_path`, a small stdlib script run by the base interpreter with ``-I -S``): the ranks it starts are
forked by the server as well, and the client relays signals to its rank and exits with the rank's status.

What differs from a real interpreter, knowingly:

- every child of one server shares its string-hash seed (one ``PYTHONHASHSEED`` per server, not per process);
- what the preloaded libraries print while they load (Megatron-Core's notices that Transformer Engine and Apex are
  absent) is in the server's log, not in each child's standard error.

A second kind of server, ``engine`` (:func:`engine_runtime_env`), forks the Ray workers of the pytest process's
own fleets with vLLM imported: Ray runs each worker as ``py_executable default_worker.py ...`` and the job's
``py_executable`` is this module's client.

``MEGATRON_PACS_ZYGOTE=0`` turns it off (every launch a plain subprocess, every engine the real interpreter).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# the launches' RAY_RUNTIME_ENV_HOOK: in every server's sys.modules, where Ray's load_class finds it in the children
from zygote_ray_hook import HOOK

__all__ = [
    "RUNTIME_ONLY",
    "ZygotePopen",
    "client_path",
    "enabled",
    "engine_runtime_env",
    "forks",
    "popen",
    "recipe_env",
    "run",
    "served_children",
    "shutdown",
]

#: Imported by every server before it serves: what a trainer rank, torchrun and the suite's check scripts import.
PRELOAD = (
    "torch",
    "torch.distributed.run",
    "megatron.core",
    "megatron_pacs.trainer",
    "megatron_pacs.checkpointing",
)
#: Imported by an engine server (:func:`engine_runtime_env`): a vLLM engine actor's start is ~8.5 CPU-s on CPU, of
#: which importing vLLM is ~6 (it imports Inductor even with ``TORCH_COMPILE_DISABLE``).
ENGINE_PRELOAD = ("torch", "vllm", "megatron_pacs.rollout.vllm_backend.engine")
#: Names of transformers' lazy module touched after the imports (each loads its submodule).
PRELOAD_TRANSFORMERS = ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "AutoModelForCausalLM")

#: Environment variables read at run time only (never while the preloaded libraries load): a launch may differ from
#: its server in these and in ``PYTHONPATH`` (more folders); any other difference needs a server of its own.
RUNTIME_ONLY = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTHON_EXEC",
        "PYTHONUNBUFFERED",
        "PYTEST_CURRENT_TEST",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCHELASTIC_ENABLE_FILE_TIMER",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_ELASTIC_WORKER_IDENTIFIER",
        "NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_MODULE_LOADING",
        "CUDA_VISIBLE_DEVICES",
        "LD_LIBRARY_PATH",  # the loader reads it at a process's start: the child's own subprocesses get it
        "MEGATRON_PACS_STOP_MARKER",
        "MEGATRON_PACS_CLEAN_STOPS",
        "MEGATRON_PACS_RAY_TEMP_IN_LOG_DIR",
        "MEGATRON_PACS_RECORD_GOLDEN",
        "ZYGOTE_SOCKET",
        "ZYGOTE_CLIENT",
        "ZYGOTE_ENGINE_SOCKET",
        # what a shell sets in its children's environment, and Slurm in a batch job's
        "SHLVL",
        "_",
        "PWD",
        "OLDPWD",
        "ENVIRONMENT",
        "HOSTNAME",
        # read when CUDA starts (examples/lib/recipe.bash exports it)
        "CUDA_DEVICE_MAX_CONNECTIONS",
    }
    # the recipes' own variables (examples/*.sh, examples/lib/, examples/slurm/): read by the scripts only
    | {
        "DRY_RUN",
        "EXIT_SIGNAL_GRACE_SECONDS",
        "EXP_NAME",
        "GPUS_PER_NODE",
        "HF_MODEL",
        "LOG_DIR",
        "MODEL_ARGS",
        "NNODES",
        "NODE_IP",
        "NODE_RANK",
        "NUM_ENGINES",
        "NUM_GPUS",
        "PACS_BETA",
        "PYTHON",
        "RECIPE",
        "RECIPE_ARGS",
        "REF_RESET_INTERVAL",
        "REPO_ROOT",
        "ROLLOUT_SOURCE",
        "ROUTER_REPLAY",
        "SAVE_DIR",
        "SAVE_INTERVAL",
        "SCRIPT_DIR",
        "SIGNAL_MARGIN_SECONDS",
        "STOP_DIR",
        "TRAIN_DATA",
        "TRAIN_ITERS",
        "VAL_DATA",
        "VAL_FILES",
    }
)

_SOCKET_ENV = "ZYGOTE_SOCKET"
_ENABLED_ENV = "MEGATRON_PACS_ZYGOTE"
_HERE = Path(__file__).resolve().parent
_MAX_FDS = 3


def enabled() -> bool:
    """Launches go through the fork servers (``MEGATRON_PACS_ZYGOTE=0``: plain subprocesses)."""
    return os.environ.get(_ENABLED_ENV, "1") != "0" and sys.platform == "linux"


# -- the protocol: a 4-byte length and a JSON body; the request carries the child's standard streams ---------------


def _send(sock: socket.socket, body: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(body).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
    else:
        sock.sendall(payload)


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    """One message (None at the end of the stream) and the file descriptors that came with it."""
    fds: list[int] = []
    buf = b""
    while len(buf) < 4:
        if with_fds and not buf:
            data, ancdata, _, _ = sock.recvmsg(4, socket.CMSG_LEN(_MAX_FDS * 4))
            for level, kind, raw in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])
        else:
            data = sock.recv(4 - len(buf))
        if not data:
            return None, fds
        buf += data
    (size,) = struct.unpack("!I", buf)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# -- what a command line asks for ------------------------------------------------------------------------------------


def parse_command(argv: list[str]) -> dict | None:
    """``python`` arguments this module runs: ``{"unbuffered", "module" | "script", "args"}``, or None.

    Args:
        argv: The arguments after the interpreter.
    """
    unbuffered = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-u", "-B"):
            unbuffered |= arg == "-u"
            i += 1
        elif arg in ("-uB", "-Bu"):
            unbuffered = True
            i += 1
        elif arg == "-m" and i + 1 < len(argv):
            return {"unbuffered": unbuffered, "module": argv[i + 1], "args": argv[i + 2 :]}
        elif arg.startswith("-"):
            return None
        else:
            return {"unbuffered": unbuffered, "script": arg, "args": argv[i + 1 :]}
    return None


#: Prefixes of more such variables: torchrun's agent's; pytest's; those of libraries the servers never import (vLLM,
#: Ray, TileLang: the in-process tests' imports of vLLM set some in pytest's own environment); Inductor's and Triton's
#: compile settings (where a launch compiles, they change how, never what); and those read when CUDA, cuBLAS, NCCL
#: or Transformer Engine start (in the child, never at import; ``--deterministic-mode`` sets some in-process).
RUNTIME_ONLY_PREFIXES = (
    "TORCHELASTIC_",
    "TORCH_ELASTIC_",
    "PYTEST_",
    "VLLM_",
    "RAY_",
    "TILELANG_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "CUBLAS_",
    "NCCL_",
    "NVTE_",
    "PYTORCH_NVML_",
    "SLURM_",
    "SLURMD_",
    "SBATCH_",
    "SRUN_",
    "SALLOC_",
)


def _runtime_only(name: str, kind: str = "python") -> bool:
    if kind == "engine" and name.startswith("VLLM_"):  # an engine server imports vLLM, which reads its log level
        return False
    return name in RUNTIME_ONLY or name.startswith(RUNTIME_ONLY_PREFIXES)


def _profile(env: dict[str, str], kind: str = "python") -> dict[str, str]:
    """What a server's environment must equal: everything but the run-time-only variables and ``PYTHONPATH``."""
    return {k: v for k, v in env.items() if not _runtime_only(k, kind) and k != "PYTHONPATH"}


def _extra_path(env: dict[str, str]) -> list[str] | None:
    """A launch's ``PYTHONPATH`` folders (a server starts without any), or None where one holds more than a
    ``sitecustomize.py``: a package there could be one a preloaded module looked for and did not find (Triton's
    interpreter for the fused kernels' tests), so such a launch runs as a plain subprocess."""
    folders = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for folder in folders:
        if _is_checkout(folder):  # the recipes put it there (examples/lib/recipe.bash)
            continue
        try:
            names = {n for n in os.listdir(folder) if n != "__pycache__"}
        except OSError:
            return None
        if not names <= {"sitecustomize.py"}:
            return None
    return folders


def _is_checkout(folder: str) -> bool:
    """Whether ``folder`` is the checkout whose ``megatron_pacs`` the servers import (its editable install): on
    ``sys.path`` it adds that same package, and folders of scripts and tests that no library looks for."""
    global _CHECKOUT
    if _CHECKOUT is None:
        import importlib.util

        spec = importlib.util.find_spec("megatron_pacs")
        locations = list(spec.submodule_search_locations or []) if spec else []
        _CHECKOUT = str(Path(locations[0]).resolve().parent) if locations else ""
    return bool(_CHECKOUT) and str(Path(folder).resolve()) == _CHECKOUT


_CHECKOUT: str | None = None


# -- the server ------------------------------------------------------------------------------------------------------


def _serve(sock_path: str, kind: str = "python") -> None:
    """The server's main: preload, then fork a child per request until its socket is removed."""
    import importlib

    own_env = dict(os.environ)
    if kind == "engine":
        # Not Ray: its core reads the worker's own variables (RAY_JOB_ID, ...) once, so a child of a server that had
        # loaded it failed its start ("Check failed: !job_id_env.empty()"). vLLM imports it where it is installed,
        # optionally (its Ray executor, unused by an engine in one process): each child imports Ray itself.
        sys.modules["ray"] = None  # type: ignore[assignment] - what makes `import ray` raise ImportError
    try:
        for name in PRELOAD if kind == "python" else ENGINE_PRELOAD:
            importlib.import_module(name)
        import transformers

        for name in PRELOAD_TRANSFORMERS:
            getattr(transformers, name)
        if kind == "engine":
            import vllm

            vllm.LLM  # noqa: B018 - vLLM's lazy module: this loads the engine's classes
    finally:
        if sys.modules.get("ray", 0) is None:
            del sys.modules["ray"]
    blocked = [m for m in ("ray", "vllm", "math_verify") if m in sys.modules]
    threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    if len(threads) != 1:  # a fork would copy a lock another thread holds
        raise RuntimeError(f"the fork server has {threads} {_THREADED}; it forks only from one")
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects: never walked by the children's collections, their pages stay shared

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in pytest: the session's exit ends the server
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    edges = Path(sock_path).parent / "edges"
    edges.mkdir(exist_ok=True)
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    import selectors

    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    parent = os.getppid()
    # ends with its socket (shutdown) or with the session that started it (a pytest ended by SIGTERM runs no atexit)
    while Path(sock_path).exists() and os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                request, fds = _recv(conn, with_fds=True)
                why = None if request is None else _refusal(request, own_env, kind)
                if request is None or len(fds) != 3 or why is not None:
                    if why is not None:
                        print(f"refused: {why}", file=sys.stderr, flush=True)
                        with contextlib.suppress(OSError):
                            _send(conn, {"refused": why})
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                request["extra_path"] = _extra_path(request["env"])
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    _child(conn, request, fds, blocked)  # never returns
                for fd in fds:
                    os.close(fd)
                command = request["command"]
                print(f"forked {pid}: {command.get('module') or command.get('script')}", file=sys.stderr, flush=True)
                children[pid], by_conn[conn] = conn, pid
                if request.get("client_pid"):
                    (edges / str(pid)).write_text(str(request["client_pid"]))
                _send(conn, {"pid": pid})
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            else:  # a client's end of the stream: it died (SIGKILL); its child goes with it
                conn = key.fileobj
                with contextlib.suppress(OSError):
                    if conn.recv(1, socket.MSG_PEEK):  # type: ignore[union-attr]
                        continue
                pid = by_conn.pop(conn, None)  # type: ignore[arg-type]
                sel.unregister(conn)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            with contextlib.suppress(FileNotFoundError):
                (edges / str(pid)).unlink()
            if conn is None:
                continue
            if by_conn.pop(conn, None) is not None:
                sel.unregister(conn)
            with contextlib.suppress(OSError):
                _send(conn, {"status": status})
            conn.close()
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _refusal(request: dict, own_env: dict[str, str], kind: str) -> str | None:
    """Why this server cannot run ``request`` (its environment differs where the preloaded libraries read it)."""
    env = request["env"]
    mine, theirs = _profile(own_env, kind), _profile(env, kind)
    differs = sorted(k for k in mine.keys() | theirs.keys() if env.get(k) != own_env.get(k))
    if differs:
        return f"the environment differs in {differs}"
    if _extra_path(env) is None:
        return f"a PYTHONPATH folder holds more than a sitecustomize.py: {env.get('PYTHONPATH')}"
    return None


def _child(conn: socket.socket, request: dict, fds: list[int], blocked: list[str]) -> None:
    """In the forked child: become the requested interpreter, run the program, exit as Python exits."""
    code = 1
    try:
        os.setsid()
        if request.get("client_pid"):
            _enter_namespaces(request["client_pid"])
        if request.get("nice") is not None:
            with contextlib.suppress(OSError):
                Path("/proc/self/autogroup").write_text(str(request["nice"]))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        command = request["command"]
        unbuffered = bool(command["unbuffered"] or request["env"].get("PYTHONUNBUFFERED"))
        sys.stdout.reconfigure(write_through=unbuffered)  # type: ignore[union-attr]
        extra = request.get("extra_path") or []
        # sys.path as the interpreter builds it: the program's folder first, then PYTHONPATH, then the rest
        first = os.getcwd() if "module" in command else str(Path(command["script"]).resolve().parent)
        sys.path[:] = [first, *extra, *sys.path[1:]]
        if any((Path(p) / "sitecustomize.py").is_file() for p in extra):
            if blocked:
                raise RuntimeError(f"a sitecustomize on PYTHONPATH, but the server imported {blocked}")
            import importlib

            sys.modules.pop("sitecustomize", None)
            importlib.import_module("sitecustomize")
        import runpy

        sys.executable = request["executable"]
        try:
            if "module" in command:
                sys.argv = [command["module"], *command["args"]]
                sys.modules.pop(command["module"], None)  # run as __main__ afresh, as `python -m` does
                runpy.run_module(command["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [command["script"], *command["args"]]
                runpy.run_path(command["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's exit after an unhandled Ctrl-C: by SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            code = 130
        except BaseException:  # noqa: BLE001 - the interpreter's report of an unhandled exception
            sys.excepthook(*sys.exc_info())
            code = 1
        _finish()
    except BaseException:  # noqa: BLE001 - set-up failed: report it on the child's stderr
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


#: The namespaces a child joins where its client's differ from the server's, in this order (a mount namespace's
#: join resets the folder, set after it), with their ``setns`` flags.
_NAMESPACES = (("net", 0x40000000), ("mnt", 0x00020000))  # CLONE_NEWNET, CLONE_NEWNS


def _enter_namespaces(client_pid: int) -> None:
    """Join the client's network and mount namespaces where they are not the server's: a client started by ``ip
    netns exec`` (the virtual cluster's hosts, tests/cluster/netns.py) gets its child on its host, where ``ip netns
    pids`` finds and ends it, with the host's ``/etc/hosts``. Python 3.11 has no ``os.setns``: libc's, by ctypes."""
    import ctypes

    libc = None
    for name, flag in _NAMESPACES:
        theirs, mine = os.stat(f"/proc/{client_pid}/ns/{name}"), os.stat(f"/proc/self/ns/{name}")
        if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
            continue
        libc = libc or ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/proc/{client_pid}/ns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into process {client_pid}'s {name} namespace: {os.strerror(err)}")
        finally:
            os.close(fd)


def _exit_code(exc: SystemExit) -> int:
    """The status Python exits with for ``SystemExit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at its exit before it tears down: join non-daemon threads, run ``atexit``."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


# -- the client side -------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_CLIENT_LOCK = threading.Lock()
_SERVERS: dict[str, tuple[subprocess.Popen, str, dict[str, str]]] = {}  # profile hash -> (process, socket, env)
_ROOT: str | None = None
_UNSERVABLE: set[str] = set()  # profiles whose imports start a thread
_REQUESTS: dict[str, int] = {}  # profile -> launches asked for
_THREADED = "threads after its imports"


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
                [sys.executable, str(Path(__file__).resolve()), sock, kind],
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
            line = proc.stdout.readline()  # after its imports
            if line.strip() != "ready":
                proc.kill()
                proc.wait()
                log.close()
                text = (folder / "log").read_text()
                if _THREADED in text:
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


def engine_runtime_env(env: dict[str, str]) -> dict[str, Any] | None:
    """A local Ray job's ``runtime_env`` whose workers are forked by an engine server (:data:`ENGINE_PRELOAD`
    imported) where their environment is ``env``'s: the fleet's engine actors, whose environment is the driver's plus
    the backend's ``actor_env``. Ray starts each worker as ``py_executable default_worker.py ...``; the client
    (:func:`client_path`) asks the server, and runs the real interpreter where the server refuses (another
    environment: Ray's other workers) or is not up yet (it is started here, in the background). None where the fork
    servers are off."""
    if not enabled():
        return None
    sock = _engine_socket(env)
    return None if sock is None else {"py_executable": client_path(), "env_vars": {_SOCKET_ENV: sock}}


def _engine_socket(env: dict[str, str], *, wait: bool = False) -> str | None:
    """The socket of the engine server for workers whose environment is ``env`` (``wait``: for its imports)."""
    # the raylet sets it for every worker it starts (setproctitle, which the preloaded libraries import, reads it)
    server = _server_for({**env, "SPT_NOENV": "1"}, kind="engine", wait=wait)
    return None if server is None else server[0]


def _launch_engines(env: dict[str, str]) -> dict[str, str]:
    """What a launch forked by a python server gets in its environment so that the engine actors of its own local
    Ray are forked by an engine server too (tests/zygote_ray_hook.py): their environment is the launch's plus the
    backend's ``actor_env``, which reads the driver's vLLM log level. The server is waited for (once per
    environment, in a launch thread): every launch then forks its engines, whatever the load."""
    from megatron_pacs.rollout.vllm_backend.engine import VLLMEngine

    actor = {**VLLMEngine.actor_env(on_gpu=False), "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")}
    sock = _engine_socket({**env, **actor}, wait=True)
    if sock is None:
        return {}
    return {"RAY_RUNTIME_ENV_HOOK": HOOK, "ZYGOTE_CLIENT": client_path(), "ZYGOTE_ENGINE_SOCKET": sock}


def _starts_engines(command: dict) -> bool:
    """Whether a launch may start a fleet: ``megatron_pacs.train`` (under torchrun too), not a synthetic source, a
    help or a dry run."""
    args = command["args"]
    trains = command.get("module") == "megatron_pacs.train" or (
        command.get("module") == "torch.distributed.run" and "megatron_pacs.train" in args
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

    def plain() -> subprocess.Popen:
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
    server = _server_for(env, at_request=2) if _extra_path(env) is not None else None
    if server is None:
        return plain()
    served = {**env, **_launch_engines(env)} if _starts_engines(command) else dict(env)
    if command.get("module") == "torch.distributed.run":  # its ranks forked by the same server (module docstring)
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
        return plain()


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


if __name__ == "__main__":
    _serve(sys.argv[1], *sys.argv[2:3])
