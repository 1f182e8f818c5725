"""Dataset preparation: every PACS source shape, malformed rows, the prompt-length filter, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_pacs.data import (
    INSTRUCTION,
    BadRowError,
    apply_chat_template,
    prepare_dataset,
    read_prompt_rows,
)

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_is_question_space_instruction():
    assert INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."


def test_deepscaler_json_list(tmp_path):
    src = tmp_path / "deepscaler.json"
    src.write_text(json.dumps([{"problem": "What is 1+1?", "answer": "2", "solution": "1+1=2"}]))
    rows, skipped = read_prompt_rows(src)
    assert skipped == 0 and rows[0].data_source == "deepscaler"
    assert rows[0].prompt == [{"role": "user", "content": "What is 1+1? " + INSTRUCTION}]
    assert rows[0].ground_truth == "2" and rows[0].extra_info["solution"] == "1+1=2"


def test_math500_jsonl_keeps_unique_id(tmp_path):
    src = write_jsonl(
        tmp_path / "test.jsonl", [{"problem": "p", "answer": "\\frac{1}{2}", "unique_id": "test/a/1.json"}]
    )
    rows, _ = read_prompt_rows(src, data_source="math_500")
    assert (
        rows[0].id == "test/a/1.json" and rows[0].ground_truth == "\\frac{1}{2}" and rows[0].data_source == "math_500"
    )


def test_gsm8k_parquet_takes_text_after_hashes(tmp_path):
    src = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "How many?", "answer": "Work 5*2=10\n#### 1,000"}]), src)
    rows, _ = read_prompt_rows(src)
    assert rows[0].ground_truth == "1000" and rows[0].question == "How many?"


def test_aime_2024_capitalised_int_answers_and_amc_floats(tmp_path):
    aime = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204}]), aime)
    amc = tmp_path / "amc.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "Find y.", "answer": 27.0}, {"question": "z?", "answer": 2.5}]), amc
    )
    (row,), _ = read_prompt_rows(aime)
    assert row.ground_truth == "204" and row.id == "2024-I-1"
    rows, _ = read_prompt_rows(amc)
    assert [r.ground_truth for r in rows] == ["27", "2.5"]


def test_malformed_rows_name_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b"}\nnot json\n{"problem": "", "answer": "1"}\n')
    with pytest.raises(BadRowError, match=r"bad.jsonl:2: no answer"):
        read_prompt_rows(src)
    rows, skipped = read_prompt_rows(src, skip_bad_rows=True)
    assert len(rows) == 1 and skipped == 3


def test_duplicate_ids_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "problem": "a", "answer": "1"}] * 2)
    with pytest.raises(ValueError, match="id 'x' appears more than once"):
        read_prompt_rows(src)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_is_idempotent(tmp_path, suffix):
    src = write_jsonl(tmp_path / "src.jsonl", [{"problem": f"q{i}", "answer": str(i), "level": i} for i in range(3)])
    out = tmp_path / f"out{suffix}"
    report = prepare_dataset(src, out, data_source="mine")
    assert report.num_written == 3 and out.is_file()
    again, _ = read_prompt_rows(out)
    first, _ = read_prompt_rows(src, data_source="mine")
    assert [r.to_dict() for r in again] == [r.to_dict() for r in first]
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"


def test_prompt_length_filter(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    src = write_jsonl(
        tmp_path / "s.jsonl",
        [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 1+1? " * 200, "answer": "2"}],
    )
    short = len(apply_chat_template(tok, read_prompt_rows(src)[0][0].prompt))
    report = prepare_dataset(src, tmp_path / "o.jsonl", tokenizer_dir=str(tiny_tokenizer_dir), max_prompt_length=short)
    assert report.num_written == 1 and report.num_too_long == 1
    with pytest.raises(ValueError, match="go together"):
        prepare_dataset(src, tmp_path / "o2.jsonl", max_prompt_length=10)
    # the trainer's load drops the same prompt and counts it (reported every step as data/dropped_prompts)
    from megatron_pacs.config import DataConfig
    from megatron_pacs.data.prepare import load_prompts

    prepared = tmp_path / "all.jsonl"
    prepare_dataset(src, prepared)
    train, val, dropped = load_prompts(DataConfig(train_data=[str(prepared)]), tok, short)
    assert len(train) == 1 and val == {} and dropped == 1


def test_cli_reports_and_fails_cleanly(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b"}])
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "prepare_data.py"),
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 2 and "s.jsonl:2" in bad.stderr and "--skip-bad-rows" in bad.stderr
    assert not (tmp_path / "o.jsonl").exists()
    ok = subprocess.run([*cmd, "--skip-bad-rows"], capture_output=True, text=True)
    assert ok.returncode == 0 and "wrote 1 rows" in ok.stdout and "1 malformed rows skipped" in ok.stdout


@pytest.mark.parametrize(
    ("name", "count"), [("math500", 500), ("aime2024", 30), ("aime2025", 30), ("amc23", 40), ("train_sample", 2000)]
)
def test_shared_datasets(shared_data, tmp_path, name, count):
    report = prepare_dataset(shared_data / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    assert report.num_written == count and report.num_bad_skipped == 0
    rows, _ = read_prompt_rows(tmp_path / f"{name}.jsonl")
    assert all(r.prompt[0]["content"].endswith(" " + INSTRUCTION) for r in rows)
