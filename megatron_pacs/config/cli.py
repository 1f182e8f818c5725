"""The command line, generated from the config: one flag per field, its docstring as ``--help``.

``tensor_model_parallel_size`` becomes ``--tensor-model-parallel-size`` (Megatron-LM's spelling where one exists);
booleans get ``--flag`` / ``--no-flag``; lists take several values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
from functools import cache
from typing import Any, get_type_hints

from megatron_pacs.config.base import flag
from megatron_pacs.config.train import TrainConfig

__all__ = ["add_section_flags", "build_parser", "field_docs", "parse_config", "section_from_args", "sections"]


def sections() -> dict[str, type]:
    """``TrainConfig``'s sections: field name -> dataclass."""
    hints = get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its ``--help`` text), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _argument(section: str, f: dataclasses.Field, kind: Any, doc: str) -> dict[str, Any]:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "help": doc, "default": default}
    if kind is bool or kind == bool | None:  # --x / --no-x; an optional one keeps None (automatic) by default
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == list[str]:
        kwargs.update(nargs="+", type=str, metavar=f.name.upper())
    else:
        options = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
        kwargs.update(type=next(t for t in options if t is not type(None)), metavar=f.name.upper())
    return kwargs


def add_section_flags(
    parser: argparse.ArgumentParser, section: str, cls: type, *, exclude: tuple[str, ...] = ()
) -> None:
    """Add one section's flags to a tool's parser (fields in ``exclude`` keep their defaults)."""
    group = parser.add_argument_group(section, cls.__doc__)
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name not in exclude:
            group.add_argument(flag(f.name), **_argument(section, f, hints[f.name], docs.get(f.name, "")))


def section_from_args(args: argparse.Namespace, section: str, cls: type, **overrides: Any) -> Any:
    """The section's dataclass from parsed flags added by :func:`add_section_flags` (plus ``overrides``)."""
    prefix = section + "."
    values = {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return cls(**values, **overrides)


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of every section; ``--help`` shows each field's docstring and default."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pacs.train",
        description="PACS / GRPO RLVR training on Megatron-Core with a Ray-managed vLLM fleet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for section, cls in sections().items():
        add_section_flags(parser, section, cls)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a validated :class:`TrainConfig` (a bad value exits 2 naming its flag)."""
    parser = build_parser()
    values: dict[str, dict[str, Any]] = {s: {} for s in sections()}
    for key, value in vars(parser.parse_args(argv)).items():
        section, name = key.split(".", 1)
        values[section][name] = value
    try:
        return TrainConfig(**{s: cls(**values[s]) for s, cls in sections().items()})
    except ValueError as exc:
        parser.error(str(exc))
