"""The fork server of tests/zygote.py: its protocol, what a command line and an environment ask for, and the server
process itself (``python tests/zygote_server.py SOCKET [python|engine]``), which preloads, then forks a child per
request. The standard library only at import (tests/zygote_client.py imports its protocol); tests/zygote.py, the side
that starts servers and asks them, says what a child is and is not.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
from pathlib import Path

# The launches' RAY_RUNTIME_ENV_HOOK: imported by every server (this module), so that Ray's load_class finds it in a
# child's sys.modules, whatever the child's sys.path.
import zygote_ray_hook  # noqa: F401

__all__ = ["ENGINE_PRELOAD", "ENGINE_START", "PRELOAD", "RUNTIME_ONLY", "RUNTIME_ONLY_PREFIXES", "parse_command"]

#: Imported by every server before it serves: what a trainer rank, torchrun and the suite's check scripts import.
PRELOAD = (
    "torch",
    "torch.distributed.run",
    "megatron.core",
    "megatron_pacs.trainer",
    "megatron_pacs.checkpointing",
)
#: Imported by an engine server (tests/zygote.py's ``engine_runtime_env``): a vLLM engine actor's start is ~8.5 CPU-s
#: on CPU, of which importing vLLM is ~6 (it imports Inductor even with ``TORCH_COMPILE_DISABLE``).
ENGINE_PRELOAD = ("torch", "vllm", "megatron_pacs.rollout.vllm_backend.engine")
#: What a CPU engine's start imports after ``vllm.LLM`` (its engine core, CPU worker and model runner, the models the
#: suite serves, the weight loader and what it reads): 716 modules, 0.45 of an engine start's 1.45 CPU-s once the
#: above are loaded (measured 2026-11-29). Preloaded where present, none of them required: a vLLM without one of
#: them still serves, and its engines import the rest themselves.
ENGINE_START = (
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.triton_utils.dispatcher",
    "vllm.utils.cpu_triton_utils",
    "compressed_tensors",
)
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


_MAX_FDS = 3
_THREADED = "threads after its imports"


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
            for name in ENGINE_START:
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
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


if __name__ == "__main__":
    _serve(sys.argv[1], *sys.argv[2:3])
