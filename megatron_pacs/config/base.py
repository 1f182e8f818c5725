"""What every config section shares: the flag spelling of a field and the error that names it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["bad", "flag", "is_set"]


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + name.replace("_", "-")


def bad(name: str, problem: str) -> ValueError:
    """A ``ValueError`` for field ``name`` that starts with its flag, so library and CLI users read the same fix."""
    return ValueError(f"{flag(name)}: {problem}")


def is_set(section: DataclassInstance, name: str) -> bool:
    """Whether field ``name`` of a config dataclass differs from its declared default (the one place defaults live),
    e.g. to refuse a setting whose switch is off rather than ignore it."""
    import dataclasses

    f = next(f for f in dataclasses.fields(section) if f.name == name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return getattr(section, name) != default
