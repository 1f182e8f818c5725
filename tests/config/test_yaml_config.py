"""``--config FILE.yaml``: every flag by its field name under its section, the command line on top; the config a run
writes beside its metrics reproduces it; unknown keys, misplaced fields and values of the wrong type are refused
with the nearest name, the right section or the expected type."""

import dataclasses

import pytest

from megatron_pacs.config import build_parser, parse_config, sections
from megatron_pacs.utils.sinks import CONFIG_FILE, MetricsWriter

ARGV = [
    "--hf-model",
    "models/tiny",
    "--train-data",
    "a.jsonl",
    "b.parquet",
    "--val-data",
    "v.jsonl",
    "--eval-interval",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--lr",
    "3e-7",
    "--bf16",
    "--no-dump-rollouts",
    "--rollout-engine-kwargs",
    '{"enforce_eager": true, "max_num_seqs": 4}',
    "--max-logprob-diff",
    "0.5",
    "--log-samples",
    "3",
    "--wandb-project",
    "p",
]


def _refusal(capsys, path) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_config(["--config", str(path)])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_the_config_a_run_writes_reproduces_it(tmp_path):
    """What MetricsWriter writes for a run (its resolved config) read back with --config: the same TrainConfig."""
    cfg = parse_config(ARGV)
    with MetricsWriter(tmp_path, tensorboard=False, config=cfg.to_dict()):
        pass
    written = tmp_path / CONFIG_FILE
    assert written.read_text().startswith("# This run's resolved configuration")
    assert "log_dir" not in written.read_text()  # one run per --log-dir: a rerun takes a new one
    assert parse_config(["--config", str(written)]) == cfg
    # the command line overrides the file, field by field
    again = parse_config(["--config", str(written), "--lr", "1e-6", "--no-bf16", "--train-data", "c.jsonl"])
    assert (again.optim.lr, again.model.bf16, again.data.train_data) == (1e-6, False, ["c.jsonl"])
    assert dataclasses.replace(again, optim=cfg.optim, model=cfg.model, data=cfg.data) == cfg


def test_the_documented_rerun_of_a_run_that_saved_checkpoints_works(tmp_path):
    """Issue 53, item 8: the documented ``--config <log-dir>/config.yaml --log-dir NEW`` was refused for any run with
    --save, whose checkpoints refuse a fresh run there. The docs and the file's header now say to add
    ``--save NEW_CKPT``, which works; a --load of --save's own checkpoints (a requeued job's) is left out of the file,
    so the rerun starts afresh instead of resuming this run. In-process: the written file and the run's start-up
    checks (no model, nothing launched)."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (tmp_path / "train.jsonl").write_text("")
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    argv = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl"), "--save", str(ckpt)]
    cfg = parse_config([*argv, "--load", str(ckpt), "--save-interval", "2"])
    with MetricsWriter(logs, tensorboard=False, config=cfg.to_dict()):
        pass
    (ckpt / "iter_0000002").mkdir(parents=True)  # what the run saved
    (ckpt / "iter_0000002" / "megatron_pacs.json").write_text("{}")
    text = (logs / CONFIG_FILE).read_text()
    assert f"# It saved its checkpoints to {ckpt}: give the rerun its own, --save NEW_CKPT." in text
    assert f"# load: {ckpt} (this run's own checkpoints) is left out: a rerun starts afresh." in text
    new = ["--log-dir", str(tmp_path / "new"), "--save", str(tmp_path / "ckpt2")]
    again = parse_config(["--config", str(logs / CONFIG_FILE), *new])
    again.validate(1)  # was: "--load ... resumes" this run's checkpoints from --save's old folder
    assert (again.checkpoint.load, again.checkpoint.save_interval) == (None, 2)
    assert dataclasses.replace(again, checkpoint=cfg.checkpoint, run=cfg.run) == cfg
    with pytest.raises(ValueError, match=r"^--save: .* already holds checkpoints"):  # without a --save of its own
        parse_config(["--config", str(logs / CONFIG_FILE), "--log-dir", str(tmp_path / "new")]).validate(1)
    # a --load of checkpoints elsewhere (the run started from them) is the run's recipe: kept
    (tmp_path / "base" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "base" / "iter_0000001" / "megatron_pacs.json").write_text("{}")
    cfg = parse_config([*argv, "--load", str(tmp_path / "base")])
    with MetricsWriter(tmp_path / "logs2", tensorboard=False, config=cfg.to_dict()):
        pass
    assert parse_config(["--config", str(tmp_path / "logs2" / CONFIG_FILE)]) == cfg


def test_a_hand_written_file_reads_values_as_their_flags_do(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "model:\n  hf_model: m\n  bf16: true\n"
        "optim:\n  lr: 1e-6\n"  # YAML reads 1e-6 as text; the flag's type makes it a float
        "data:\n  train_data: one.jsonl\n"  # one path for a list
        "rollout:\n  rollout_engine_kwargs: {enforce_eager: true}\n  temperature: 1\n"
        "run:\n  wandb_project: null\n"
        "reference: {}\n"
    )
    cfg = parse_config(["--config", str(tmp_path / "run.yaml")])
    assert (cfg.model.hf_model, cfg.model.bf16, cfg.optim.lr) == ("m", True, 1e-6)
    assert cfg.data.train_data == ["one.jsonl"] and cfg.rollout.rollout_engine_kwargs == {"enforce_eager": True}
    assert isinstance(cfg.rollout.temperature, float)


def test_every_field_is_a_key_of_its_section():
    """Each flag's parser destination is ``section.field``: the file's nesting covers every flag."""
    dests = {a.dest for a in build_parser()._actions if a.option_strings and a.dest not in ("help", "config")}
    assert dests == {f"{s}.{f.name}" for s, cls in sections().items() for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("modle:\n  hf_model: m\n", "'modle': no such section; did you mean 'model'?"),
        ("parallel:\n  tensor_model_paralel_size: 2\n", "did you mean 'tensor_model_parallel_size'?"),
        ("tensor_model_parallel_size: 2\n", "is a field of section 'parallel'"),
        ("optim:\n  tensor_model_parallel_size: 2\n", "'tensor_model_parallel_size' belongs under `parallel:`"),
        ("run:\n  log-samples: 2\n", "spelled with underscores: 'log_samples'"),
        ("parallel:\n  tensor_model_parallel_size: two\n", "parallel.tensor_model_parallel_size: expected int"),
        ("model:\n  bf16: 'yes'\n", "model.bf16: expected true or false"),
        ("model:\n  hf_model: null\n", "model.hf_model: needs a value"),
        ("- a list\n", "expected a mapping of sections"),
        ("model: [1]\n", "model: expected a mapping of its fields"),
        ("model:\n  hf_model: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_keys_and_values_are_refused_with_the_fix(tmp_path, capsys, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    err = _refusal(capsys, path)
    assert f"--config {path}: " in err and expected in err, err


def test_a_value_the_section_refuses_names_its_flag(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("run:\n  log_samples: -1\n")
    assert "--log-samples: -1 must be >= 0" in _refusal(capsys, tmp_path / "run.yaml")
    assert "--config: cannot read it" not in _refusal(capsys, tmp_path / "missing.yaml")
    assert "cannot read it" in _refusal(capsys, tmp_path / "missing.yaml")


def test_help_lists_the_config_flag():
    assert "--config FILE.yaml" in build_parser().format_help()
