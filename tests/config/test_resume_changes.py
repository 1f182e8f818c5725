"""What a resumed run may change: the checkpoint's configuration against the new launch's."""

import pytest

from megatron_pacs.config import parse_config
from megatron_pacs.config.resume import resume_changes


def saved_and_now(saved_argv, now_argv):
    return parse_config(saved_argv).to_dict(), parse_config(now_argv).to_dict()


def test_changes_that_break_the_saved_state_are_refused():
    saved, now = saved_and_now(["--seed", "1"], ["--seed", "2"])
    with pytest.raises(ValueError, match=r"--seed: 1 in the checkpoint, 2 now; the loader's saved position"):
        resume_changes(saved, now, pending_rollouts=False)
    saved, now = saved_and_now(["--group-size", "8"], ["--group-size", "4"])
    with pytest.raises(ValueError, match=r"--group-size: .*holds the next step's rollouts"):
        resume_changes(saved, now, pending_rollouts=True)
    assert resume_changes(saved, now, pending_rollouts=False) == ["--group-size: 8 -> 4"]


def test_recipe_changes_are_reported_and_placement_changes_are_free():
    saved, now = saved_and_now(
        ["--lr", "1e-6", "--train-iters", "10", "--save", "a"],
        [
            *("--lr", "2e-6", "--pacs-beta", "2", "--train-iters", "20", "--save", "b", "--load", "b"),
            *(
                "--tensor-model-parallel-size",
                "2",
                "--num-engines",
                "4",
                "--log-dir",
                "runs/x",
                "--reward-workers",
                "8",
            ),
        ],
    )
    assert resume_changes(saved, now, pending_rollouts=False) == ["--pacs-beta: 1.0 -> 2.0", "--lr: 1e-06 -> 2e-06"]
    assert resume_changes(saved, saved, pending_rollouts=True) == []


def test_a_field_added_since_the_checkpoint_is_not_a_change():
    saved, now = saved_and_now([], ["--lr", "2e-6"])
    del saved["optim"]["lr"], saved["run"]["dump_rollouts"]  # an older checkpoint: fields it did not have
    assert resume_changes(saved, now, pending_rollouts=False) == []
