"""Read prompt datasets in the shapes the PACS datasets come in and convert rows to :class:`PromptRow`.

Recognised shapes (by field names, per row):

| source                | question   | answer                      |
|-----------------------|------------|-----------------------------|
| DeepScaleR, MATH-500  | problem    | answer                      |
| GSM8K                 | question   | answer, final answer after ``####`` |
| AIME 2024             | Problem    | Answer (int)                |
| AIME 2025             | problem    | answer                      |
| AMC23                 | question   | answer (float, ``27.0``)    |
| megatron_pacs shared  | problem    | answer (+ id, source)       |
| canonical (ours)      | prompt     | ground_truth                |

Files: ``.jsonl``, ``.json`` (a list of objects, or JSON Lines), ``.parquet``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_pacs.data.prompts import PromptRow, build_messages

__all__ = ["BadRowError", "normalize_ground_truth", "read_prompt_rows", "read_records", "to_prompt_row", "write_rows"]

QUESTION_KEYS = ("problem", "Problem", "question", "Question")
ANSWER_KEYS = ("answer", "Answer", "final_answer", "ground_truth")
ID_KEYS = ("id", "unique_id", "ID", "idx", "index")


_NON_FINITE = ("nan", "inf", "infinity")


class BadRowError(ValueError):
    """A row that cannot be converted; the message names the file and line (1-based; row index for Parquet)."""


def read_records(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_or_row_number, record)`` from a JSON, JSON Lines or Parquet file.

    A line that is not valid UTF-8 or not valid JSON is yielded as a :class:`BadRowError` instance naming the file
    and line, so the caller decides whether to skip it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    if suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl or .parquet")
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if suffix == ".json" and head.startswith(b"["):
            raw = f.read()
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                line_no = raw.count(b"\n", 0, e.start) + 1
                raise BadRowError(f"{path}:{line_no}: not UTF-8 text ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise BadRowError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
            yield from enumerate(data, start=1)
            return
        for lineno, raw_line in enumerate(f, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, BadRowError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, BadRowError(f"{path}:{lineno}: invalid JSON ({e.msg})")


def _first(rec: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in rec and rec[k] is not None:
            return k, rec[k]
    return None, None


def normalize_ground_truth(ground_truth: Any) -> str:
    """A ground truth as a string: ints as written, integral floats without ``.0`` (AMC's ``27.0`` -> ``27``).

    Raises:
        TypeError: for anything but str, int or float, and for NaN and infinities (a float ``nan``/``inf`` or the
            text a serialiser writes for one), which no response can match.
    """
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground truth must be a string or a number, got bool {ground_truth!r}")
    if isinstance(ground_truth, int):
        return str(ground_truth)
    if isinstance(ground_truth, float):
        if not math.isfinite(ground_truth):
            raise TypeError(f"ground truth must be a finite number, got {ground_truth!r}")
        return str(int(ground_truth)) if ground_truth.is_integer() else repr(ground_truth)
    if isinstance(ground_truth, str):
        if ground_truth.strip().lower().lstrip("+-") in _NON_FINITE:
            raise TypeError(f"ground truth must be a finite number, got {ground_truth!r}")
        return ground_truth.strip()
    raise TypeError(f"ground truth must be a string or a number, got {type(ground_truth).__name__}")


def _answer_text(value: Any, where: str) -> str:
    if isinstance(value, str) and "####" in value:  # GSM8K: the final answer follows '####'
        value = value.split("####")[-1].strip().replace(",", "")
    try:
        text = normalize_ground_truth(value)
    except TypeError as e:
        raise BadRowError(f"{where}: {e}") from None
    if not text:
        raise BadRowError(f"{where}: the answer is empty")
    return text


def to_prompt_row(rec: Any, *, data_source: str, where: str, index: int) -> PromptRow:
    """Convert one source record to the canonical row.

    Args:
        rec: The parsed record.
        data_source: Name stored in the row (a row's own ``data_source`` wins for canonical input).
        where: ``file:line`` for error messages.
        index: Fallback id when the record has none.

    Raises:
        BadRowError: naming ``where`` and the missing or malformed field.
    """
    if isinstance(rec, BadRowError):
        raise rec
    if not isinstance(rec, dict):
        raise BadRowError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "prompt" in rec and "ground_truth" in rec:  # already canonical
        prompt = rec["prompt"]
        if not isinstance(prompt, list) or not prompt or not all(_is_message(m) for m in prompt):
            raise BadRowError(
                f"{where}: 'prompt' must be a non-empty list of {{'role': str, 'content': str}} messages, got "
                f"{type(prompt).__name__} {str(prompt)[:80]!r}"
            )
        q = rec.get("question") or prompt[-1]["content"]
        extra = rec.get("extra_info") or {}
        if isinstance(extra, str):  # Parquet stores it as JSON text
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise BadRowError(f"{where}: 'extra_info' is not valid JSON text ({e.msg})") from None
        if not isinstance(extra, dict):
            raise BadRowError(f"{where}: 'extra_info' must be an object, got {type(extra).__name__}")
        if not isinstance(q, str):
            raise BadRowError(f"{where}: 'question' must be a string, got {type(q).__name__}")
        try:
            return PromptRow(
                id=str(rec.get("id", index)),
                data_source=str(rec.get("data_source") or data_source),
                prompt=rec["prompt"],
                ground_truth=_answer_text(rec["ground_truth"], where),
                question=q,
                extra_info=extra,
            )
        except (ValueError, AttributeError) as e:
            raise BadRowError(f"{where}: {e}") from None
    qkey, question = _first(rec, QUESTION_KEYS)
    if not isinstance(question, str) or not question.strip():
        raise BadRowError(f"{where}: no question text; expected a non-empty string in one of {list(QUESTION_KEYS)}")
    akey, answer = _first(rec, ANSWER_KEYS)
    if akey is None:
        raise BadRowError(f"{where}: no answer; expected one of {list(ANSWER_KEYS)}")
    answer_text = _answer_text(answer, where)
    _, rid = _first(rec, ID_KEYS)
    extra = {k: v for k, v in rec.items() if k not in (qkey, akey) and k not in ID_KEYS}
    if isinstance(answer, str) and "####" in answer:
        extra["solution"] = answer
    return PromptRow(
        id=str(rid if rid is not None else f"{data_source}-{index}"),
        data_source=data_source,
        prompt=build_messages(question.strip()),
        ground_truth=answer_text,
        question=question.strip(),
        extra_info=extra,
    )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role", "user"), str)


def read_prompt_rows(
    path: str | os.PathLike, *, data_source: str | None = None, skip_bad_rows: bool = False
) -> tuple[list[PromptRow], int]:
    """Read a dataset file into canonical rows.

    Args:
        path: ``.json``, ``.jsonl`` or ``.parquet`` file.
        data_source: Name for the rows; default the file's stem (e.g. ``math500``).
        skip_bad_rows: Skip malformed rows (and count them) instead of raising.

    Returns:
        ``(rows, num_skipped)``.

    Raises:
        BadRowError: on the first malformed row unless ``skip_bad_rows``; names the file and line.
    """
    source = data_source or Path(path).stem
    rows: list[PromptRow] = []
    skipped = 0
    for n, rec in read_records(path):
        try:
            rows.append(to_prompt_row(rec, data_source=source, where=f"{path}:{n}", index=n - 1))
        except BadRowError:
            if not skip_bad_rows:
                raise
            skipped += 1
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: id {dup!r} appears more than once; ids must be unique within a data source")
    return rows, skipped


def write_rows(rows: list[PromptRow], path: str | os.PathLike) -> None:
    """Write canonical rows as ``.jsonl`` or ``.parquet``, atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            records = [dict(r.to_dict(), extra_info=json.dumps(r.extra_info)) for r in rows]
            pq.write_table(pa.Table.from_pylist(records), tmp)
        elif path.suffix.lower() == ".jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
        else:
            raise ValueError(f"{path}: unsupported output type {path.suffix!r}; use .jsonl or .parquet")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
