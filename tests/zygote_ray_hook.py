"""``RAY_RUNTIME_ENV_HOOK`` of the suite's launches: their local Ray jobs' workers forked by an engine server.

A launch forked by a fork server (tests/zygote.py) gets ``RAY_RUNTIME_ENV_HOOK=zygote_ray_hook.forked_engines``,
``ZYGOTE_CLIENT`` and ``ZYGOTE_ENGINE_SOCKET`` in its environment; every fork server imports this module before it
serves, so Ray's ``load_class`` finds it in ``sys.modules`` whatever the child's ``sys.path``. A process that runs
the real interpreter never sees the hook: tests/zygote_client.py drops it before it runs the interpreter in a
server's place. Ray calls the hook in ``ray.init`` with the driver's ``runtime_env``; the job's workers then start as
the fork server's client, and the engine server forks those whose environment is its own (the fleet's engine
actors); Ray's other workers run the real interpreter.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["HOOK", "forked_engines"]

HOOK = "zygote_ray_hook.forked_engines"
"""The value of ``RAY_RUNTIME_ENV_HOOK`` that names :func:`forked_engines`."""


def forked_engines(runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
    """The driver's ``runtime_env`` with the engine server's client as its workers' interpreter; unchanged where
    the launch has no engine server or the driver names an interpreter of its own."""
    sock, client = os.environ.get("ZYGOTE_ENGINE_SOCKET"), os.environ.get("ZYGOTE_CLIENT")
    if not sock or not client or (runtime_env and "py_executable" in runtime_env):
        return runtime_env
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "ZYGOTE_SOCKET": sock}
    runtime_env["py_executable"] = client
    return runtime_env
