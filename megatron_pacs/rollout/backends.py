"""The registry of engine backends: a name (``--rollout-backend``) -> the import path of its engine class.

A backend is one module holding one class that implements :class:`~megatron_pacs.rollout.types.RolloutEngine` and
:class:`~megatron_pacs.rollout.types.FleetEngine`; it alone imports its inference library. This module imports
nothing but the standard library (the config reads :data:`BACKENDS` to check the flag), and a backend's module is
imported only when :func:`backend_class` is asked for it.

A new backend: its module under ``rollout/`` (the class, with ``engine_kwargs`` turning the generic
``RolloutConfig`` into its constructor's keywords), an entry here, and ``tests/rollout/test_backends.py`` checks
it against both protocols. Its check of ``--rollout-engine-kwargs`` is a function in a module that imports neither torch
nor its library, named in ``megatron_pacs/config/rollout.py`` (``ENGINE_ARG_CHECKS``): the config calls it, before
anything starts.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "backend_class"]

BACKENDS: dict[str, str] = {
    "vllm": "megatron_pacs.rollout.vllm_backend:VLLMEngine",
}
"""Backend name -> ``"module:Class"`` of its engine class."""

DEFAULT_BACKEND = "vllm"


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
