"""``python ARGS`` through the fork server at ``$ZYGOTE_SOCKET`` (tests/zygote.py): torchrun's ``PYTHON_EXEC``.

Run by the base interpreter with ``-I -S`` (the standard library only; tests/zygote.py writes the shebang): it
passes its standard streams, environment, working folder and autogroup nice to the server, relays the signals it
gets to the forked child, and exits as the child did. A command line the server does not run (or a server that
refuses this environment) is run by the real interpreter in its place (``exec``). ``REAL_PYTHON`` is set by the
line tests/zygote.py writes above this file's text, ``TESTS_DIR`` by the one after it.
"""

import json
import os
import signal
import socket
import struct
import sys

REAL_PYTHON = os.environ.get("ZYGOTE_REAL_PYTHON", "")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec_real() -> None:
    # the launches' Ray hook (tests/zygote_ray_hook.py) is importable in a server's children only
    if os.environ.get("RAY_RUNTIME_ENV_HOOK", "").startswith("zygote_ray_hook."):
        del os.environ["RAY_RUNTIME_ENV_HOOK"]
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def _nice():
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def main() -> None:
    sys.path.insert(0, TESTS_DIR)
    from zygote_server import _recv, parse_command  # the server's own protocol (the standard library only)

    command = parse_command(sys.argv[1:])
    if command is None or not os.environ.get("ZYGOTE_SOCKET"):
        _exec_real()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.environ["ZYGOTE_SOCKET"])
    except OSError:
        _exec_real()
    request = {
        "command": command,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "executable": REAL_PYTHON,
        "nice": _nice(),
        "client_pid": os.getpid(),
    }
    data = json.dumps(request).encode()
    fds = struct.pack("3i", 0, 1, 2)
    sock.sendmsg([struct.pack("!I", len(data)) + data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    reply, _ = _recv(sock)
    if reply is None or "pid" not in reply:
        sock.close()
        _exec_real()
    pid = reply["pid"]

    def relay(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    while True:
        try:
            reply, _ = _recv(sock)
            break
        except InterruptedError:
            continue
    if reply is None:
        os._exit(1)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


main()
