"""Malformed rows are reported with file:line (and skipped with ``skip_bad_rows``), never a bare exception:
non-UTF-8 bytes, empty or non-list prompts, bad ``extra_info``, non-finite ground truths."""

import json

import pytest

from megatron_pacs.data import BadRowError, read_prompt_rows
from megatron_pacs.data.formats import normalize_ground_truth

GOOD = {"problem": "What is 1+1?", "answer": "2"}
CANONICAL = {"prompt": [{"role": "user", "content": "q?"}], "ground_truth": "3", "id": "c"}


def write_lines(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"problem": "caf\xe9", "answer": "1"}', r"bad.jsonl:2: not UTF-8 text"),
        (json.dumps({**CANONICAL, "prompt": []}).encode(), r"bad.jsonl:2: 'prompt' must be a non-empty list"),
        (json.dumps({**CANONICAL, "prompt": "What is 2+2?"}).encode(), r"bad.jsonl:2: 'prompt' must be a non-emp"),
        (json.dumps({**CANONICAL, "prompt": ["q?"]}).encode(), r"bad.jsonl:2: 'prompt' must be a non-empty list"),
        (json.dumps({**CANONICAL, "extra_info": "{not json"}).encode(), r"bad.jsonl:2: 'extra_info' is not valid"),
        (json.dumps({**CANONICAL, "extra_info": [1, 2]}).encode(), r"bad.jsonl:2: 'extra_info' must be an object"),
        (b'{"problem": "x?", "answer": NaN}', r"bad.jsonl:2: ground truth must be a finite number"),
        (b'{"problem": "x?", "answer": Infinity}', r"bad.jsonl:2: ground truth must be a finite number"),
        (json.dumps({**CANONICAL, "ground_truth": "nan"}).encode(), r"bad.jsonl:2: ground truth must be a finite"),
    ],
)
def test_malformed_rows_are_reported_with_file_and_line_and_skippable(tmp_path, bad, message):
    src = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD).encode(), bad, json.dumps(CANONICAL).encode()])
    with pytest.raises(BadRowError, match=message):
        read_prompt_rows(src)
    rows, skipped = read_prompt_rows(src, skip_bad_rows=True)
    assert [r.ground_truth for r in rows] == ["2", "3"] and skipped == 1


def test_non_utf8_json_list_names_the_line(tmp_path):
    src = tmp_path / "bad.json"
    src.write_bytes(b'[\n{"problem": "a", "answer": "1"},\n{"problem": "\xff", "answer": "1"}\n]\n')
    with pytest.raises(BadRowError, match=r"bad.json:3: not UTF-8 text"):
        read_prompt_rows(src)


def test_non_finite_ground_truths_are_refused_but_infinity_answers_stay():
    for value in (float("nan"), float("inf"), -float("inf"), "NaN", "-inf"):
        with pytest.raises(TypeError, match="finite"):
            normalize_ground_truth(value)
    assert normalize_ground_truth("\\infty") == "\\infty" and normalize_ground_truth(1e300) == str(int(1e300))
