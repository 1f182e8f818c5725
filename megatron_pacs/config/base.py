"""What every config section shares: the flag spelling of a field and the error that names it."""

from __future__ import annotations

__all__ = ["bad", "flag"]


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + name.replace("_", "-")


def bad(name: str, problem: str) -> ValueError:
    """A ``ValueError`` for field ``name`` that starts with its flag, so library and CLI users read the same fix."""
    return ValueError(f"{flag(name)}: {problem}")
