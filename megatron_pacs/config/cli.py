"""The command line, generated from the config: one flag per field, its docstring as ``--help``.

``tensor_model_parallel_size`` becomes ``--tensor-model-parallel-size`` (Megatron-LM's spelling where one exists);
booleans get ``--flag`` / ``--no-flag``; lists take several values. A field declared with
:func:`~megatron_pacs.config.base.option` lists its choices (``{pacs,grpo}``) and may sit in a group of its own
(``rollout: engines``); an empty or None default is not shown. ``--config FILE.yaml`` gives the same fields by name
from a file (:mod:`megatron_pacs.config.yaml_file`), under the flags given.
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
from typing import Any, NoReturn, get_type_hints

from megatron_pacs.config.base import flag
from megatron_pacs.config.train import TrainConfig
from megatron_pacs.config.yaml_file import read_config_file

__all__ = ["add_section_flags", "build_parser", "field_docs", "parse_config", "section_from_args", "sections"]

CONFIG_FLAG = "--config"


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
    # the choices are shown, not enforced: __post_init__ refuses a bad value with the fix, for library users too
    choices = f.metadata.get("choices")
    metavar = "{" + ",".join(choices) + "}" if choices is not None else f.name.upper()
    if kind is bool or kind == bool | None:  # --x / --no-x; an optional one keeps None (automatic) by default
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == list[str]:
        kwargs.update(nargs="+", type=str, metavar=metavar)
    else:
        options = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
        kwargs.update(type=next(t for t in options if t is not type(None)), metavar=metavar)
    return kwargs


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless it is empty or None (nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default in ("", [], (), {}):
            return action.help
        return super()._get_help_string(action)


def add_section_flags(
    parser: argparse.ArgumentParser, section: str, cls: type, *, exclude: tuple[str, ...] = ()
) -> None:
    """Add one section's flags to a tool's parser (fields in ``exclude`` keep their defaults), in the section's group
    or the group of its own a field names (``rollout: engines``)."""
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        name = f.metadata.get("help_group")
        if name not in groups:
            title, about = (section, cls.__doc__) if name is None else (f"{section}: {name}", None)
            groups[name] = parser.add_argument_group(title, about)
        groups[name].add_argument(flag(f.name), **_argument(section, f, hints[f.name], docs.get(f.name, "")))


def section_from_args(args: argparse.Namespace, section: str, cls: type, **overrides: Any) -> Any:
    """The section's dataclass from parsed flags added by :func:`add_section_flags` (plus ``overrides``)."""
    prefix = section + "."
    values = {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return cls(**values, **overrides)


class _Parser(argparse.ArgumentParser):
    """A refusal is one usage line and the error, not argparse's usage block (one entry per flag: 124 lines)."""

    def format_usage(self) -> str:
        return f"usage: {self.prog} [-h] [{CONFIG_FLAG} FILE.yaml] [FLAGS ...] (--help lists every flag)\n"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.format_usage()}{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of every section; ``--help`` shows each field's docstring and default."""
    parser = _Parser(
        prog="python -m megatron_pacs.train",
        description="PACS / GRPO RLVR training on Megatron-Core with a Ray-managed vLLM fleet.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE.yaml",
        help="Read the run from a YAML file: one mapping per section below (model:, rollout:, ...), each flag by "
        "its field name; flags given here override it. A run writes its own as <log-dir>/config.yaml.",
    )
    for section, cls in sections().items():
        add_section_flags(parser, section, cls)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line, on top of ``--config FILE.yaml`` when given, into a validated :class:`TrainConfig`
    (a bad value exits 2 naming its flag, or the file and its key)."""
    parser = build_parser()
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument(CONFIG_FLAG)
    path = first.parse_known_args(argv)[0].config
    if path is not None:
        try:
            parser.set_defaults(**read_config_file(path, sections()))  # the command line still overrides them
        except ValueError as exc:
            parser.error(str(exc))
    values: dict[str, dict[str, Any]] = {s: {} for s in sections()}
    for key, value in vars(parser.parse_args(argv)).items():
        if key == "config":
            continue
        section, name = key.split(".", 1)
        values[section][name] = value
    try:
        return TrainConfig(**{s: cls(**values[s]) for s, cls in sections().items()})
    except ValueError as exc:
        parser.error(str(exc))
