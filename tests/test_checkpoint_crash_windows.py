"""Every crash window of a save closed: a real process saves checkpoints of a tiny two-tensor
model through Megatron's distributed checkpointing and is SIGKILLed at one point of its third save (during the
writes, while an ``--async-save`` writer forked for it writes, after the rename into place, before the tracker's
write, half-way through pruning). The next start resumes the newest complete checkpoint, says which, warns about a
complete one the tracker does not name, loads exactly the weights of that step (their recorded fingerprint checked),
and the next save goes on from there."""

import logging
import sys
from pathlib import Path

import pytest
import torch
from crash_save_rank import TwoTensors, weights_at
from launch_queue import run_launch

from megatron_pacs.mcore.training_checkpoint import (
    TRACKER,
    find_latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from megatron_pacs.utils.checkpoint_dirs import remove_stale_temp_folders

CHILD = Path(__file__).parent / "crash_save_rank.py"


pytestmark = pytest.mark.usefixtures("single_rank_gloo")


# point -> (the step resumed, a warning that names a complete checkpoint without a tracker entry)
EXPECTED = {
    "writes": (2, False),
    "background": (2, False),
    "rename": (3, True),
    "tracker": (3, True),
    "pruning": (3, False),
}


def prepare(root: Path) -> Path:
    return root


def _kill_saves(root: Path) -> Path:
    """One directory per point, each holding what a save killed there left."""
    cmd = [sys.executable, str(CHILD), str(root), "3", *EXPECTED]
    proc = run_launch(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for point in EXPECTED:  # wait status 9: ended by SIGKILL where it said
        assert f"killed at {point}" in proc.stdout and f"{point}: 9" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    return root


LAUNCHES = {"killed": _kill_saves}  # queued for the session (tests/launch_queue.py), beside the in-process tests


@pytest.fixture(scope="module")
def killed(launched) -> Path:
    return launched["killed"].result()


@pytest.mark.parametrize("point", list(EXPECTED))
def test_a_save_killed_at_each_point_resumes_the_newest_complete_checkpoint(killed, point, caplog):
    tmp_path = killed / point
    resumed, untracked = EXPECTED[point]
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        ckpt = find_latest_checkpoint(tmp_path)
    assert ckpt == tmp_path / f"iter_{resumed:07d}", sorted(p.name for p in tmp_path.iterdir())
    assert (
        "iter_0000003, complete and descending from it, was written later without a tracker entry" in caplog.text
    ) == untracked, caplog.text
    assert ("resuming from iter_0000003" in caplog.text) == untracked
    model = TwoTensors()
    assert load_training_checkpoint(ckpt, [model], None)["step"] == resumed
    for key, value in weights_at(resumed).items():
        assert torch.equal(getattr(model, key).detach(), value), key
    remove_stale_temp_folders(tmp_path)  # what the next start does under the run lock
    save_training_checkpoint(tmp_path, resumed + 1, [TwoTensors(resumed + 1)], None, {}, parent=ckpt)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".iter", "iter")))
    assert names == [ckpt.name, f"iter_{resumed + 1:07d}"]
    assert (tmp_path / TRACKER).read_text() == f"{resumed + 1}\n"
