"""A tiny name -> object registry that refuses duplicates and lists the valid names in its errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps option names (as given on the command line) to implementations.

    Args:
        option: The user-facing option name, used in error messages (e.g. ``"advantage"``).
    """

    def __init__(self, option: str) -> None:
        self.option = option
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; a second registration of a name is an error."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.option} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """Return the implementation for ``name`` or raise a ``ValueError`` listing the valid names."""
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"{self.option}={name!r} is not a valid option; choose one of {sorted(self._items)}"
            ) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
