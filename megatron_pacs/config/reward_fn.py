"""A reward of the user's own (``--reward-fn module:function``), found by name in each reward worker.

The function is called as ``fn(response, ground_truth)`` with the decoded response (prompt excluded) and the row's
``ground_truth`` as the data file holds it, and returns a number in [0, 1] or a bool (1.0 or 0.0); anything else (an
exception, a value that is not a number such as the string ``"1"``, NaN, a value outside [0, 1]) scores 0.0 and
counts as an error (``reward/num_errors``), as math-verify's errors do
(:func:`megatron_pacs.rewards.scorer.reward_value`). See docs/training.md ("Your own reward") and
examples/custom_reward.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["load_reward_fn"]


@cache
def load_reward_fn(spec: str) -> Callable[[Any, Any], Any]:
    """The function ``spec`` names: ``package.module:function`` (importable from the working directory or
    ``PYTHONPATH``) or ``path/to/file.py:function``.

    Raises:
        ValueError: saying what is wrong (no ``:``, a module that does not import, no such attribute, not callable,
            or a function that cannot take ``(response, ground_truth)``).
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f'"{spec}": give module:function or path/to/file.py:function')
    try:
        module = _import(module_name)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises while importing
        raise ValueError(
            f'"{module_name}" does not import ({type(exc).__name__}: {exc}); it must be importable from the '
            "working directory or PYTHONPATH, or be given as path/to/file.py:function"
        ) from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f'"{module_name}" has no "{attr}"')
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f'"{spec}" is a {type(fn).__name__}, not a function')
    try:
        inspect.signature(fn).bind("response", "ground truth")
    except TypeError:
        raise ValueError(f'"{spec}" must take two arguments: fn(response: str, ground_truth: str) -> float') from None
    except ValueError:  # no signature to read (some builtins): it is called as is
        pass
    return fn


def _import(module_name: str) -> Any:
    """A module by dotted name, or a ``.py`` file loaded under a name of its own (once per process)."""
    if not (module_name.endswith(".py") or os.sep in module_name or "/" in module_name):
        return importlib.import_module(module_name)
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
        raise ValueError(f'"{module_name}": no such file')
    name = "megatron_pacs_reward_fn_" + str(abs(hash(path)))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
