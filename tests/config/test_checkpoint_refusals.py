"""what --load and --save refuse before anything is built, through ``TrainConfig.validate`` and the
trainer's command line: damaged checkpoints named (never a silent fresh start), a second run on one --save, and a
changed seed or changed rows on resume."""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from megatron_pacs.config import parse_config
from megatron_pacs.train import main


@pytest.fixture
def files(tmp_path):
    """A model directory and a data file as validation sees them (config.json; the file exists)."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (tmp_path / "train.jsonl").write_text("")
    return ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]


def _damaged(root, step, content):
    folder = root / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    if content is not None:
        (folder / "megatron_pacs.json").write_text(content)
    return folder


def train(*argv, cwd):
    cmd = [sys.executable, "-m", "megatron_pacs.train", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_load_whose_checkpoints_are_all_damaged_is_refused_naming_each_file(tmp_path, files):
    """--load (also --save's own directory) holding only unreadable checkpoints is refused, naming every
    damaged metadata file; a fresh start needs --load-optional."""
    run = tmp_path / "run"
    _damaged(run, 3, "")
    _damaged(run, 5, None)
    (run / "latest_checkpointed_iteration.txt").write_text("5\n")
    for argv in (["--load", run], ["--save", run, "--load", run]):
        with pytest.raises(ValueError) as caught:
            parse_config([*files, *map(str, argv)]).validate(1)
        message = str(caught.value)
        assert message.startswith("--load: ") and "holds checkpoints but none is readable and complete" in message
        assert f"{run}/iter_0000003/megatron_pacs.json is empty" in message
        assert f"{run}/iter_0000005/megatron_pacs.json does not exist" in message and "--load-optional" in message
    parse_config([*files, "--save", str(run), "--load", str(run), "--load-optional"]).validate(1)


def test_a_damaged_checkpoint_is_refused_in_one_line_naming_its_file_before_anything_starts(tmp_path, files):
    """Through the trainer's command line: exit 2 and one line naming the file, in seconds (no
    model, no engine; never a fresh start from scratch, nor only "Expecting value: line 1 column 1")."""
    run = tmp_path / "run"
    _damaged(run, 3, "")
    proc = train(*files, "--save", run, "--load", run, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --load: ") and f"{run}/iter_0000003/megatron_pacs.json is empty" in line
    with pytest.raises(ValueError, match=rf"^--load: {re.escape(str(run))}/iter_0000003/megatron_pacs.json is empty"):
        main([*files, "--save", str(run), "--load", str(run / "iter_0000003")])
    assert sorted(os.listdir(run)) == ["iter_0000003"]  # nothing trained, nothing written


def test_a_second_run_on_one_save_is_refused_naming_the_holder(tmp_path, files):
    """rank 0 holds the --save directory's lock for the whole run; a second run is refused with one
    line naming the holder's host and pid."""
    from megatron_pacs.utils.run_lock import RunLock

    run = tmp_path / "run"
    with RunLock(run), pytest.raises(ValueError) as caught:
        main([*files, "--save", str(run), "--load", str(run)])
    message = str(caught.value)
    assert message.startswith(f"--save: {run} is in use by another run (host ") and "\n" not in message
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started" in message


@pytest.fixture
def resumable(tmp_path):
    """A tokenizer and model config (no weights: the refusals come before any model is built), its data, and a
    checkpoint's metadata (the run's config and data position)."""
    from helpers.runs import TINY_RUN_FLAGS
    from transformers import AutoTokenizer

    from megatron_pacs.data.loader import PromptLoader
    from megatron_pacs.data.prepare import load_prompts
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=512)
    tok.save_pretrained(tmp_path / "model")
    tiny_hf_config("qwen2", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2).save_pretrained(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in make_problems(8, seed=0, split="train"))
    )
    flags = ["--hf-model", tmp_path / "model", "--train-data", tmp_path / "train.jsonl", *TINY_RUN_FLAGS]
    flags += ["--save", tmp_path / "run", "--load", tmp_path / "run"]
    cfg = parse_config(list(map(str, flags)))
    rows, _, _ = load_prompts(cfg.data, AutoTokenizer.from_pretrained(cfg.model.hf_model), cfg.batch.max_prompt_length)
    loader = PromptLoader(rows, cfg.batch.global_batch_size, seed=cfg.run.seed)
    loader.next_batch()
    meta = {"step": 1, "loader": loader.state_dict(), "config": cfg.to_dict(), "pending_step": None}
    ckpt = tmp_path / "run" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "megatron_pacs.json").write_text(json.dumps(meta))
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("1\n")
    return flags, rows, loader


def test_a_changed_seed_is_refused_before_any_model_is_built(tmp_path, resumable, monkeypatch):
    """the seed and data-set checks of a resume come from the metadata, right after the data loads
    (not after the whole start-up): the trainer is never imported."""
    flags, _, _ = resumable
    monkeypatch.setitem(sys.modules, "megatron_pacs.trainer", None)  # importing it would fail
    with pytest.raises(ValueError, match=r"^--seed: 1 in the checkpoint, 2 now"):
        main([*map(str, flags), "--seed", "2"])


def test_changed_rows_are_refused_on_resume_unless_allowed(tmp_path, resumable):
    """Through the resume's plan (what train.py checks before building the trainer)."""
    from megatron_pacs.checkpointing import plan_resume
    from megatron_pacs.data.loader import PromptLoader

    flags, rows, loader = resumable
    changed = [dataclasses.replace(rows[0], ground_truth="12345"), *rows[1:]]
    current = PromptLoader(changed, loader.batch_size, seed=1)
    cfg = parse_config(list(map(str, flags)))
    with pytest.raises(ValueError, match=r"--train-data: .*content changed .*--allow-changed-rows"):
        plan_resume(cfg, current)
    plan = plan_resume(parse_config([*map(str, flags), "--allow-changed-rows"]), current)
    assert plan.checkpoint == tmp_path / "run" / "iter_0000001"
    assert any("--allow-changed-rows" in note for note in plan.notes)
    assert plan_resume(cfg, PromptLoader(rows, loader.batch_size, seed=1)).notes == []
