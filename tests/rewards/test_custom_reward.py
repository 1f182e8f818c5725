"""``--reward-fn module:function``: a user's reward scored in the real worker pool with the same time-out and error
accounting as math-verify's, the example in examples/custom_reward.py, and a bad name refused at the command line,
naming the flag, before anything starts."""

import textwrap
from pathlib import Path

import pytest

from megatron_pacs.config import parse_config
from megatron_pacs.rewards import RewardScorer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_reward.py"

REWARD_MODULE = '''
import time


def by_response(response, ground_truth):
    """The response says what to do: a score, an error, a value out of range, or a hang."""
    if response == "raise":
        raise RuntimeError("a bug in the reward")
    if response == "hang":
        time.sleep(60)
    if response == "nan":
        return float("nan")
    if response == "two":
        return 2.0
    if response == "text one":
        return "1"  # a string is no score, whatever it spells
    if response == "yes":
        return True
    if response == "no":
        return False
    if response == "pair":
        return (1.0, "ok")  # neither is a tuple
    if response == "raise again":
        raise RuntimeError("the same bug")
    if response == "key":
        return {}["missing"]
    return 1.0 if response == ground_truth else 0.25



def counted(response, ground_truth):
    """Appends each call's response to the file $REWARD_CALLS names."""
    import os

    with open(os.environ["REWARD_CALLS"], "a") as f:
        f.write(response + "\\n")
    return 1.0


NOT_A_FUNCTION = 3


def one_argument(response):
    return 1.0
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module ``my_reward`` importable by name (from sys.path, which spawned workers inherit)."""
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_reward.py"


def test_a_custom_reward_in_the_worker_pool_keeps_the_timeout_and_error_accounting(reward_module):
    responses = ["7", "8", "raise", "nan", "two", "hang", "7"]
    with RewardScorer(num_workers=2, timeout_s=2.0, reward_fn="my_reward:by_response") as scorer:
        out = scorer.score(responses, ["7"] * len(responses))
    assert out.scores == [1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert out.statuses == ["ok", "ok", "error", "error", "error", "timeout", "ok"]
    assert (out.num_errors, out.num_timeouts) == (3, 1)


def test_a_reward_is_a_number_or_a_bool_and_nothing_else(reward_module, caplog):
    """Issue 53, item 2: ``"1"`` scored 1.0 (``float(out)``), undercounting ``reward/num_errors``; a bool is 1.0 or
    0.0 by the documented rule, and a tuple is no score. The first error of each kind is shown once, with its item
    (the warning counted errors and never showed one). Serial scoring: the same rule as the pool's, no process."""
    responses = ["text one", "yes", "no", "pair", "raise", "raise again", "key", "nan", "two", "7"]
    with caplog.at_level("WARNING", logger="megatron_pacs.rewards"):
        with RewardScorer(num_workers=0, reward_fn="my_reward:by_response") as scorer:
            out = scorer.score(responses, ["7"] * len(responses))
            scorer.score(["text one", "raise"], ["7", "7"])  # kinds already shown: counted, not shown again
    assert out.scores == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert out.statuses == ["error", "ok", "ok", "error", "error", "error", "error", "error", "error", "ok"]
    assert out.num_errors == 7
    shown = [r.getMessage() for r in caplog.records if "shown once" in r.getMessage()]
    assert len(shown) == 5, shown  # a str, a tuple, RuntimeError (twice in the batch), KeyError, out of range (x2)
    assert "returned a str ('1'), not a number on item 0" in shown[0]
    assert "raised RuntimeError: a bug in the reward on item 4" in shown[2]
    assert all(line.startswith("reward: --reward-fn my_reward:by_response ") for line in shown)


def test_a_user_reward_is_called_on_the_items_only(reward_module, tmp_path, monkeypatch):
    """Issue 53, note 3: every worker (and each replacement) called the user's function once as a warm-up, which
    cost a slow reward its time-out again at every replacement. One spawned worker, about 2 s."""
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("REWARD_CALLS", str(calls))  # the spawned worker inherits it
    with RewardScorer(num_workers=1, timeout_s=5.0, reward_fn="my_reward:counted") as scorer:
        assert scorer.score(["a", "b"], ["a", "b"]).scores == [1.0, 1.0]
    assert calls.read_text().split() == ["a", "b"]


def test_a_reward_given_by_file_path_runs_serially_too(reward_module):
    with RewardScorer(num_workers=0, reward_fn=f"{reward_module}:by_response") as scorer:
        assert scorer.score(["7", "raise"], ["7", "7"]).scores == [1.0, 0.0]


def test_the_example_reward_grades_format_correctness_and_length():
    with RewardScorer(num_workers=0, reward_fn=f"{EXAMPLE}:boxed_reward") as scorer:
        out = scorer.score(
            ["so \\boxed{27}", "so \\boxed{26}", "27", "\\boxed{27} or \\boxed{26}", "x" * 4000 + " \\boxed{27}"],
            ["27"] * 5,
        )
    assert out.scores[:4] == [1.0, 0.1, 0.0, 0.0]
    assert 0.45 < out.scores[4] < 0.55  # about twice the length budget: about half
    assert out.num_errors == 0


@pytest.mark.parametrize(
    "spec, why",
    [
        ("my_reward", "give module:function"),
        ("no_such_module_xyz:f", "does not import"),
        ("my_reward:nope", 'has no "nope"'),
        ("my_reward:NOT_A_FUNCTION", "is a int, not a function"),
        ("my_reward:one_argument", "must take two arguments"),
        ("missing/file.py:f", "no such file"),
    ],
)
def test_a_bad_reward_fn_is_refused_at_the_command_line_naming_the_flag(reward_module, capsys, spec, why):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--reward-fn", spec])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--reward-fn: " in err and why in err


def test_a_good_reward_fn_is_kept_from_the_command_line_and_a_config_file(reward_module, tmp_path):
    assert parse_config(["--reward-fn", "my_reward:by_response"]).reward.reward_fn == "my_reward:by_response"
    (tmp_path / "run.yaml").write_text(f"reward:\n  reward_fn: {EXAMPLE}:boxed_reward\n")
    assert parse_config(["--config", str(tmp_path / "run.yaml")]).reward.reward_fn == f"{EXAMPLE}:boxed_reward"
    scorer = RewardScorer.from_config(parse_config(["--reward-fn", "my_reward:by_response"]).reward)
    assert scorer.reward_fn == "my_reward:by_response"
