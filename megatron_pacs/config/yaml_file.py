"""A run described by a YAML file (``--config FILE.yaml``): one mapping per config section, every flag by its field
name, the command line on top.

The top-level keys are :class:`~megatron_pacs.config.TrainConfig`'s sections, as ``--help`` names its groups (a
group such as ``rollout: engines`` is part of ``rollout:``); under each, fields by their name, as a run writes them
to ``<log-dir>/config.yaml``::

    model:
      hf_model: Qwen/Qwen2.5-0.5B
    parallel:
      tensor_model_parallel_size: 2
    optim:
      lr: 1.0e-6

A value is read as its flag reads it (``lr: 1e-6``, which YAML reads as text, is a float here); a key that is no
field is refused with the nearest name, and a field under the wrong section with the section it belongs to.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from pathlib import Path
from typing import Any, get_type_hints

__all__ = ["read_config_file"]


def read_config_file(path: str | Path, sections: dict[str, type]) -> dict[str, Any]:
    """The values a YAML config file sets, keyed as the parser's destinations (``"parallel.lr"``).

    Args:
        path: The file (``--config``).
        sections: Section name -> its dataclass (:func:`~megatron_pacs.config.cli.sections`).

    Returns:
        ``{"section.field": value}`` for every field the file sets, each value of its field's type.

    Raises:
        ValueError: starting with ``--config PATH`` and naming the key and the fix (a missing or unreadable file,
            YAML that is not a mapping of sections, an unknown key, a value of the wrong type).
    """
    import yaml  # deferred: only a run given --config reads YAML

    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of sections ({', '.join(sections)}), got {type(data).__name__}")
    owner = {f.name: s for s, cls in sections.items() for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for section, fields in data.items():
        if section not in sections:
            raise ValueError(f"{where}: {_unknown(str(section), None, sections, owner)}")
        if fields is None:
            continue
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: {section}: expected a mapping of its fields, got {type(fields).__name__}")
        cls = sections[section]
        hints = get_type_hints(cls)
        for name, value in fields.items():
            if name not in hints:
                raise ValueError(f"{where}: {section}.{name}: {_unknown(str(name), section, sections, owner)}")
            try:
                out[f"{section}.{name}"] = _coerce(hints[name], value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: {section}.{name}: {exc}") from None
    return out


def _unknown(key: str, section: str | None, sections: dict[str, type], owner: dict[str, str]) -> str:
    """Why ``key`` (top-level when ``section`` is None) is refused, with the fix."""
    snake = key.replace("-", "_")
    if section is None and snake in owner:
        return f"{key!r} is a field of section {owner[snake]!r}: nest it as `{owner[snake]}:` / `  {snake}: ...`"
    if section is not None and snake in owner and owner[snake] != section:
        return f"no such field in {section!r}; {snake!r} belongs under `{owner[snake]}:`"
    if snake != key and snake in owner:
        return f"no such field; fields are spelled with underscores: {snake!r}"
    names = list(sections) if section is None else [f.name for f in dataclasses.fields(sections[section])]
    what = "section" if section is None else f"field of {section!r}"
    close = difflib.get_close_matches(snake, names, n=1) or difflib.get_close_matches(snake, list(owner), n=1)
    if close:
        elsewhere = close[0] in owner and owner[close[0]] != section
        hint = f"; did you mean {close[0]!r}" + (f" (under `{owner[close[0]]}:`)" if elsewhere else "") + "?"
    else:
        hint = f"; the {'sections are ' + ', '.join(sections) if section is None else 'fields are its flags in --help'}"
    return f"{key!r}: no such {what}{hint}" if section is None else f"no such {what}{hint}"


def _coerce(kind: Any, value: Any) -> Any:
    """``value`` as a field of type ``kind`` holds it: text read as its flag reads it, other types refused."""
    options = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError("needs a value (null is only for fields whose default is null)")
    if dict in [getattr(o, "__origin__", o) for o in options] and isinstance(value, dict):
        return value  # --rollout-engine-kwargs: a mapping here, JSON text on the command line
    base = next(o for o in options if o is not type(None))
    if base == list[str]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise TypeError(f"expected a list of paths, got {value!r}")
        return list(items)
    if base is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise TypeError(f"expected {base.__name__ if base is not str else 'text'}, got {value!r}")
    if base is int and isinstance(value, float) and not value.is_integer():
        raise TypeError(f"expected an integer, got {value!r}")
    if base is str and not isinstance(value, str):
        return str(value)
    try:
        return base(value)
    except ValueError:
        raise TypeError(f"expected {base.__name__}, got {value!r}") from None
