"""What ``python -m megatron_pacs.train`` refuses or ends before it builds anything: a model folder whose
tokenizer is missing, far smaller than the model's vocabulary, encodes to nothing or has no chat template; a ``--load``
checkpoint of another model shape; a resume at or past ``--train-iters`` (nothing to train, exit 0); two validation
sets under one ``data_source``. Each runs the CLI's ``main`` in this process: a refusal returns before Megatron, Ray or
any engine starts. The checkpoints here are folders of metadata only, as the trainer writes them
(tests/test_start_checks_launch.py checks a real one)."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers.runs import TINY_SHAPE_FLAGS
from helpers.tiny_folders import make_model, make_problems

from megatron_pacs.planner import ModelShape
from megatron_pacs.train import main

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5"]
FLAGS = TINY_SHAPE_FLAGS


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("start_checks")
    make_model(root / "model")
    make_problems(root / "train.jsonl")
    return root


def _argv(root: Path, tmp_path: Path, *extra: str, model: Path | None = None, fleet: bool = False) -> list[str]:
    """The CLI's flags for a tiny run, by default without the fleet (``--rollout-source synthetic``)."""
    model = model or root / "model"
    data = str(root / "train.jsonl")
    source = [] if fleet else SYNTHETIC
    return ["--hf-model", str(model), "--train-data", data, *FLAGS, *source, "--log-dir", str(tmp_path), *extra]


def _copy_model(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root / "model", tmp_path / "model_copy"))


def _refused(argv: list[str], match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        main(argv)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_model_folder_without_tokenizer_json_is_refused_naming_it(setup, tmp_path):
    """Without tokenizer.json transformers builds a 2-token tokenizer that encodes every text to nothing, and the run
    trained on empty prompts with exit 0."""
    model = _copy_model(setup, tmp_path)
    (model / "tokenizer.json").unlink()
    match = rf"--hf-model {model} holds no tokenizer: tokenizer.json is missing .*present: tokenizer_config.json"
    _refused(_argv(setup, tmp_path, model=model), match, tmp_path)
    for name in ("tokenizer_config.json", "chat_template.jinja"):  # every tokenizer file gone
        (model / name).unlink()
    _refused(_argv(setup, tmp_path, model=model), r"holds no tokenizer: .*present: no tokenizer file", tmp_path)


def test_a_tokenizer_far_smaller_than_the_models_vocabulary_is_refused(setup, tmp_path):
    model = _copy_model(setup, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, vocab_size=151936)))
    match = rf"--hf-model {model}: its tokenizer has 512 tokens, the model's vocab_size is 151936"
    _refused(_argv(setup, tmp_path, model=model), match, tmp_path)


def test_a_tokenizer_that_encodes_a_prompt_to_nothing_is_refused(setup, tmp_path):
    """A tokenizer.json of special tokens only (an untrained BPE), beside a config of as small a vocabulary."""
    from tokenizers import Tokenizer, models

    model = _copy_model(setup, tmp_path)
    empty = Tokenizer(models.BPE())
    empty.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    empty.save(str(model / "tokenizer.json"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, vocab_size=3)))
    _refused(_argv(setup, tmp_path, model=model), r"its tokenizer encodes the text .* to no token", tmp_path)


def test_a_tokenizer_without_a_chat_template_is_refused(setup, tmp_path):
    model = _copy_model(setup, tmp_path)
    (model / "chat_template.jinja").unlink()
    _refused(_argv(setup, tmp_path, model=model), rf"--hf-model {model}: its tokenizer has no usable chat", tmp_path)


def _checkpoint(root: Path, step: int, shape: dict | None) -> Path:
    """A checkpoint folder's metadata as RunCheckpoints.save writes it (no weights: nothing here loads them)."""
    ckpt = root / f"iter_{step:07d}"
    ckpt.mkdir(parents=True)
    meta = {"step": step, "loader": {}, "written_at": 1.0, "parent": None}
    if shape is not None:
        meta["model_shape"] = shape
    (ckpt / "megatron_pacs.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    return root


def test_a_resume_at_or_past_train_iters_ends_before_anything_is_built(setup, tmp_path, capsys):
    shape = asdict(ModelShape.from_pretrained(setup / "model"))
    ckpt = _checkpoint(tmp_path / "ckpt", 4, shape)
    for iters in ("2", "4"):
        assert main(_argv(setup, tmp_path, "--load", str(ckpt), "--train-iters", iters)) == 0
        assert f"nothing to train: the checkpoint is at step 4 and --train-iters is {iters}" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_of_another_model_shape_is_refused_naming_load_and_the_field(setup, tmp_path):
    shape = asdict(ModelShape.from_pretrained(setup / "model"))
    ckpt = _checkpoint(tmp_path / "ckpt", 2, dict(shape, num_hidden_layers=4, hidden_size=128))
    match = (
        rf"--load {ckpt}: .*iter_0000002 holds a model of another shape than --hf-model {setup / 'model'}: "
        r"hidden_size 128 there, 64 here; num_hidden_layers 4 there, 2 here"
    )
    _refused(_argv(setup, tmp_path, "--load", str(ckpt), "--train-iters", "4"), match, tmp_path)


def test_a_checkpoint_without_a_recorded_shape_is_taken_as_it_was(setup, tmp_path):
    """Checkpoints written before the shape was recorded resume as before (the load itself checks the tensors)."""
    from megatron_pacs.checkpointing import check_load_at_start
    from megatron_pacs.config import parse_config

    ckpt = _checkpoint(tmp_path / "ckpt", 2, None)
    assert check_load_at_start(parse_config(_argv(setup, tmp_path, "--load", str(ckpt)))) == 2


def test_two_validation_sets_of_one_data_source_are_refused_naming_both_files(setup, tmp_path):
    """Validation is keyed by each row's data_source: va/test.jsonl and vb/test.jsonl of one source would be logged
    under one key, the first never validated."""
    va = make_problems(tmp_path / "va" / "test.jsonl", 4, data_source="test")
    vb = make_problems(tmp_path / "vb" / "test.jsonl", 4, data_source="test")
    argv = _argv(setup, tmp_path, "--val-data", str(va), str(vb), "--eval-interval", "1", fleet=True)
    _refused(argv, rf"--val-data: {va} and {vb} both hold validation rows of data_source 'test'", tmp_path)


def test_validation_sets_are_keyed_by_data_source_not_by_file_name(setup, tmp_path):
    from megatron_pacs.config import parse_config
    from megatron_pacs.data.prepare import load_prompts
    from megatron_pacs.data.tokenizer import load_checked_tokenizer

    va = make_problems(tmp_path / "va" / "test.jsonl", 4, data_source="math500")
    vb = make_problems(tmp_path / "vb" / "test.jsonl", 3, data_source="aime2024")
    cfg = parse_config(_argv(setup, tmp_path, "--val-data", str(va), str(vb), "--eval-interval", "1", fleet=True))
    _, val, _ = load_prompts(cfg.data, load_checked_tokenizer(setup / "model"), cfg.batch.max_prompt_length)
    assert {k: len(v) for k, v in val.items()} == {"math500": 4, "aime2024": 3}
