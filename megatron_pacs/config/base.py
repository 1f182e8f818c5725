"""What every config section shares: the flag spelling of a field, the error that names it, and what ``--help``
shows of a field beyond its docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["bad", "flag", "is_set", "option"]


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + name.replace("_", "-")


def option(default: Any, *, choices: Iterable[str] | None = None, group: str | None = None) -> Any:
    """A field with ``default`` and what only the command line reads: the ``choices`` ``--help`` lists (read when
    the parser is built, so a registry added to later is listed whole; the section's ``__post_init__`` still checks
    the value) and the ``--help`` group it is listed in (default: its section's)."""
    return dataclasses.field(default=default, metadata={"choices": choices, "help_group": group})


def bad(name: str, problem: str) -> ValueError:
    """A ``ValueError`` for field ``name`` that starts with its flag, so library and CLI users read the same fix."""
    return ValueError(f"{flag(name)}: {problem}")


def is_set(section: DataclassInstance, name: str) -> bool:
    """Whether field ``name`` of a config dataclass differs from its declared default (the one place defaults live),
    e.g. to refuse a setting whose switch is off rather than ignore it."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return getattr(section, name) != default
