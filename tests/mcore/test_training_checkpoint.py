"""Training checkpoints on a real single-rank gloo group (Megatron's distributed checkpointing, no model or one
tensor): which checkpoint a resume takes after a rollback, ``--keep-last`` along the lineage, corrupt metadata named, a
full disk, the RNG state loaded without running pickled code, and a save after a scheduler's SIGTERM reached every
process the rank started."""

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import time

import psutil
import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_pacs.mcore.training_checkpoint import (
    TRACKER,
    CheckpointWriteError,
    find_latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from megatron_pacs.utils.checkpoint_dirs import LINEAGE_FILE

pytestmark = pytest.mark.usefixtures("single_rank_gloo")


def save(root, step, keep_last=2, parent=None):
    """Step ``step`` descending from ``iter_<parent>`` (None: a run started from scratch)."""
    ancestor = root / f"iter_{parent:07d}" if parent is not None else None
    return save_training_checkpoint(root, step, [], None, {"branch": "any"}, parent=ancestor, keep_last=keep_last)


def steps(root):
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_") and p.name[5:].isdigit())


def set_aside(root):
    return sorted(p.name.split(".")[0] for p in root.iterdir() if ".abandoned-" in p.name)


def test_resume_after_a_rollback_takes_the_new_branch_and_keeps_its_parent(tmp_path):
    """Steps 20 and 40 saved, then a rollback to 20 saves 30. The tracker names 30; --keep-last counts
    along 30's lineage (30, 20: the rollback's parent is kept), and 40, the branch the rollback left, is set aside
    (renamed with the time), never deleted in 20's place nor loaded."""
    save(tmp_path, 20)
    save(tmp_path, 40, parent=20)
    save(tmp_path, 30, parent=20)  # the new branch, after --load .../iter_0000020
    assert (tmp_path / TRACKER).read_text() == "30\n"
    assert steps(tmp_path) == [20, 30] and set_aside(tmp_path) == ["iter_0000040"]
    assert find_latest_checkpoint(tmp_path).name == "iter_0000030"
    assert json.loads((tmp_path / "iter_0000030" / "megatron_pacs.json").read_text())["parent"] == "iter_0000020"
    save(tmp_path, 35, keep_last=1, parent=30)
    assert steps(tmp_path) == [35] and find_latest_checkpoint(tmp_path).name == "iter_0000035"


def test_keep_last_one_after_a_rollback_keeps_the_new_branch(tmp_path):
    save(tmp_path, 20, keep_last=1)
    save(tmp_path, 40, keep_last=1, parent=20)
    save(tmp_path, 10, keep_last=1)  # a fresh start in this directory (--load-optional over damaged checkpoints)
    assert steps(tmp_path) == [10] and find_latest_checkpoint(tmp_path).name == "iter_0000010"
    assert set_aside(tmp_path) == ["iter_0000040"]


def test_a_damaged_newest_checkpoint_falls_back_along_its_lineage_only(tmp_path, caplog):
    """Save 2 and 4, roll back to 2, save 3, then damage 3's metadata. The resume takes 2 (3's parent),
    not 4 (written later than 2, but the branch the user left), even with 4 put back in place; with no complete
    checkpoint on the lineage it is refused, naming the damaged file and the checkpoints off it."""
    save(tmp_path, 2)
    save(tmp_path, 4, parent=2)
    save(tmp_path, 3, parent=2)
    (abandoned,) = [p for p in tmp_path.iterdir() if ".abandoned-" in p.name]
    abandoned.rename(tmp_path / "iter_0000004")  # the user restores it by hand: still not chosen
    (tmp_path / "iter_0000003" / "megatron_pacs.json").write_text("")
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        assert find_latest_checkpoint(tmp_path).name == "iter_0000002"
    assert "iter_0000003" in caplog.text and "is empty" in caplog.text and "not from iter_0000004" in caplog.text
    shutil.rmtree(tmp_path / "iter_0000002")
    with pytest.raises(ValueError, match=r"names iter_0000003, which is damaged .*off its lineage: iter_0000004"):
        find_latest_checkpoint(tmp_path)


def test_checkpoints_without_a_recorded_lineage_fall_back_in_write_order(tmp_path):
    """Checkpoints written before lineages were recorded: a checkpoint's parent is the one written before it."""
    save(tmp_path, 1)
    latest = save(tmp_path, 2, parent=1)
    (tmp_path / LINEAGE_FILE).unlink()
    for ckpt in (tmp_path / "iter_0000001", latest):
        meta = json.loads((ckpt / "megatron_pacs.json").read_text())
        del meta["parent"]
        (ckpt / "megatron_pacs.json").write_text(json.dumps(meta))
    (latest / "megatron_pacs.json").write_text("{")
    assert find_latest_checkpoint(tmp_path).name == "iter_0000001"


def test_a_save_removes_only_its_own_temporary_folder(tmp_path):
    """Another run's write in progress (or an interrupted one) is not this save's to delete."""
    other = tmp_path / ".iter_0000005.tmp-otherrun"
    other.mkdir(parents=True)
    save(tmp_path, 1)
    assert other.is_dir() and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [other.name]


@pytest.mark.parametrize("content", ["", "{", "[1, 2]"])
def test_empty_or_corrupt_metadata_falls_back_with_a_warning(tmp_path, caplog, content):
    save(tmp_path, 1)
    latest = save(tmp_path, 2, parent=1)
    (latest / "megatron_pacs.json").write_text(content)  # a crash between open() and the write, a bad disk
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        assert find_latest_checkpoint(tmp_path).name == "iter_0000001"
    assert "iter_0000002" in caplog.text and "damaged" in caplog.text
    with pytest.raises(
        ValueError, match=r"--load: .*iter_0000002/megatron_pacs.json (is empty|is not valid JSON|holds)"
    ):
        load_training_checkpoint(latest, [], None)
    meta = load_training_checkpoint(find_latest_checkpoint(tmp_path), [], None)
    assert meta["step"] == 1 and meta["branch"] == "any"


def test_corrupt_tracker_falls_back_to_the_checkpoint_written_last(tmp_path, caplog):
    save(tmp_path, 5)
    save(tmp_path, 3, parent=5)
    (tmp_path / TRACKER).write_text("not a step")
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        assert find_latest_checkpoint(tmp_path).name == "iter_0000003"
    assert TRACKER in caplog.text
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary file left behind


@pytest.mark.parametrize("room", [8192, 0])  # an OSError from Python's writes; torch's zip writer's iostream error
def test_a_full_disk_during_a_save_says_why_and_keeps_the_previous_checkpoint(small_disk, room):
    """ENOSPC half-way through a save: one line naming the step, the directory, the OS error and the
    checkpoint that will resume; the temporary folder removed; the previous checkpoint and the tracker untouched."""
    root = small_disk / "ckpt"
    save(root, 1)
    before = {p.name: p.read_bytes() for p in (root / "iter_0000001").iterdir()}
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - room))  # room for some files of the save, or none
    with pytest.raises(CheckpointWriteError) as caught:
        save(root, 2, parent=1)
    message = str(caught.value)
    assert "\n" not in message
    for part in ("step 2", str(root), "No space left on device", "resumes from", "iter_0000001"):
        assert part in message, (part, message)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".megatron")) == [
        LINEAGE_FILE,
        "iter_0000001",
        TRACKER,
    ]
    assert (root / TRACKER).read_text() == "1\n"
    assert {p.name: p.read_bytes() for p in (root / "iter_0000001").iterdir()} == before
    (small_disk / "filler").unlink()
    assert find_latest_checkpoint(root).name == "iter_0000001"
    save(root, 2, parent=1)  # space again: the next save goes through


class _RunsCodeOnLoad:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_rng_state_loads_without_running_pickled_code(tmp_path, monkeypatch):
    """The RNG file is loaded with ``weights_only=True``; a pickle that runs code is refused."""
    monkeypatch.chdir(tmp_path)
    ckpt = save(tmp_path, 1)
    good = torch.load(ckpt / "rng_rank00000.pt", weights_only=True)
    assert set(good) == {"python", "torch", "cuda"}
    torch.save({"python": _RunsCodeOnLoad()}, ckpt / "rng_rank00000.pt")
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        load_training_checkpoint(ckpt, [], None)
    assert not (tmp_path / "pwned").exists()
    assert json.loads((ckpt / "megatron_pacs.json").read_text())["step"] == 1


class _OneTensor(torch.nn.Module):
    """What a model gives a save (its sharded state dict), with one tensor for Megatron's writer to write."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(8.0))

    def sharded_state_dict(self):
        return {"weight": ShardedTensor.from_rank_offsets("weight", self.weight.detach(), replica_id=0)}


def test_a_save_after_sigterm_to_every_process_the_rank_started_goes_through(tmp_path):
    """Slurm's warning SIGTERM (``--signal``, a preemption) reaches every process of the job step. Megatron's
    checkpoint writer keeps a queue server, a child process started at the first save; it died of that SIGTERM, and
    the save ``--exit-signal-handler`` makes next failed with ``Broken pipe`` (seen in the Slurm time-limit test when
    the signal came after a periodic save). Only background saves use that server now (a synchronous one reads its
    results in the rank's own process); here: a background save, SIGTERM to the queue's server, a background save
    and a synchronous one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_pacs.mcore import training_checkpoint
    from megatron_pacs.mcore.async_checkpoint import start_training_checkpoint

    model = _OneTensor()
    meta = {"branch": "any"}
    assert start_training_checkpoint(tmp_path, 1, [model], None, meta, parent=None, keep_last=3).finish(blocking=True)
    # the queue's server, started by this save or an earlier one in this process (test_async_checkpoint's)
    servers = [psutil.Process(p.pid) for p in mp.active_children() if p.name.startswith("SyncManager")]
    assert len(servers) == 1, mp.active_children()
    servers[0].send_signal(signal.SIGTERM)
    time.sleep(0.5)  # a process that dies of the signal is gone by now
    assert servers[0].is_running() and servers[0].status() != psutil.STATUS_ZOMBIE
    with torch.no_grad():
        model.weight.add_(1.0)
    pending = start_training_checkpoint(tmp_path, 2, [model], None, meta, parent=tmp_path / "iter_0000001")
    assert pending.finish(blocking=True)
    ckpt = save_training_checkpoint(tmp_path, 3, [model], None, meta, parent=tmp_path / "iter_0000002", keep_last=3)
    assert filesystem_async._results_queue is training_checkpoint._in_process_results  # no server for this one
    assert ckpt.name == "iter_0000003" and find_latest_checkpoint(tmp_path) == ckpt
