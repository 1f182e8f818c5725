"""The registry of engine backends: a name (``--rollout-backend``) -> the import path of its engine class.

A backend is one module holding one class that implements :class:`~megatron_pacs.rollout.types.RolloutEngine` and
:class:`~megatron_pacs.rollout.types.FleetEngine`; it alone imports its inference library. This module imports
nothing but the standard library (the config reads :data:`BACKENDS` to check the flag), and a backend's module is
imported only when :func:`backend_class` is asked for it.

A new backend: its module under ``rollout/`` (the class, with ``engine_kwargs`` turning the generic
``RolloutConfig`` into its constructor's keywords), an entry here, and ``tests/rollout/test_backends.py`` checks
it against both protocols. Its check of ``--rollout-engine-kwargs`` (:data:`ENGINE_ARG_CHECKS`) is a function in a
module that imports neither torch nor its library: the config calls it, before anything starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ENGINE_ARG_CHECKS", "backend_class", "check_engine_kwargs"]

BACKENDS: dict[str, str] = {
    "vllm": "megatron_pacs.rollout.vllm_backend:VLLMEngine",
}
"""Backend name -> ``"module:Class"`` of its engine class."""

DEFAULT_BACKEND = "vllm"

ENGINE_ARG_CHECKS: dict[str, str] = {
    "vllm": "megatron_pacs.rollout.vllm_backend.engine_args:check_engine_kwargs",
}
"""Backend name -> ``"module:function"`` that refuses bad ``--rollout-engine-kwargs`` (a ``ValueError`` naming the
flag); its module imports neither torch nor the backend's library."""


def backend_class(name: str) -> type[Any]:
    """Import and return the engine class registered under ``name`` (a
    :class:`~megatron_pacs.rollout.types.FleetEngine`; not imported here, which the config's import of this module
    would make a circle).

    Raises:
        ValueError: ``name`` is not registered (the message names ``--rollout-backend`` and the choices).
    """
    if name not in BACKENDS:
        raise ValueError(f"--rollout-backend: unknown engine backend {name!r}; use one of {list(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def check_engine_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Check ``--rollout-engine-kwargs`` against backend ``name``'s accepted engine arguments (the config's hook:
    it imports the backend's light check module only, never torch or the inference library).

    Raises:
        ValueError: ``name`` is not registered, or the backend refuses a name (naming the flag and the fix).
    """
    if name not in BACKENDS:
        raise ValueError(f"--rollout-backend: unknown engine backend {name!r}; use one of {list(BACKENDS)}")
    module, _, function = ENGINE_ARG_CHECKS[name].partition(":")
    check: Callable[[dict[str, Any]], None] = getattr(importlib.import_module(module), function)
    check(kwargs)
