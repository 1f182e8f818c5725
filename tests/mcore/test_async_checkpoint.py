"""Training checkpoints written in the background (``--async-save``) on a real single-rank gloo group with Megatron's
asynchronous writer (a process forked per save): the checkpoint holds the values at the save even when the tensors
change while it is written, it appears only once committed, and a full disk during the background writes gives one
line naming the step, the directory and the OS error, with the previous checkpoint kept and the temporary folder
removed."""

import shutil
from typing import Any, cast

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_pacs.mcore.async_checkpoint import start_training_checkpoint
from megatron_pacs.mcore.training_checkpoint import (
    TRACKER,
    CheckpointWriteError,
    find_latest_checkpoint,
    load_training_checkpoint,
)

pytestmark = pytest.mark.usefixtures("single_rank_gloo")


class _Weights(torch.nn.Module):
    """What a model gives a save (its sharded state dict): one tensor of ``n`` values."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(float(n)))

    def sharded_state_dict(self):
        return {"weight": ShardedTensor.from_rank_offsets("weight", self.weight.detach(), replica_id=0)}


def _save(root, step, model, parent=None):
    return start_training_checkpoint(root, step, [model], None, {"step_state": step}, parent=parent)


def test_a_background_save_holds_the_values_at_the_save_and_appears_only_when_committed(tmp_path):
    """The tensor is changed in place right after the save starts (the next step's update): the checkpoint still
    holds the values handed to the writer, and no ``iter_*`` folder or tracker exists before the commit."""
    root = tmp_path / "ckpt"
    model = _Weights(1 << 16)
    saved = model.weight.detach().clone()
    pending = _save(root, 1, model)
    with torch.no_grad():
        model.weight.add_(1.0)  # the training goes on
    assert not (root / "iter_0000001").exists() and not (root / TRACKER).exists()
    assert pending.finish(blocking=True)
    assert (root / TRACKER).read_text() == "1\n"
    fresh = _Weights(1 << 16)
    meta = load_training_checkpoint(root / "iter_0000001", cast(Any, [fresh]), None)  # checks the fingerprint too
    assert meta["step_state"] == 1
    assert torch.equal(fresh.weight.detach(), saved)


def test_pruned_checkpoints_are_deleted_off_the_step_and_gone_after_a_waited_save(tmp_path):
    """``--keep-last 1`` with background saves, whose commits delete the pruned checkpoints in a background thread:
    the newest checkpoint is always the one resumed, and a save waited for (the run's last) leaves nothing of the
    pruned ones behind."""
    root = tmp_path / "ckpt"
    model, parent = _Weights(1 << 12), None
    for step in (1, 2, 3):
        pending = start_training_checkpoint(root, step, [model], None, {"s": step}, parent=parent, keep_last=1)
        assert pending.finish(blocking=step == 3) or pending.finish(blocking=True)
        parent = pending.path
        assert find_latest_checkpoint(root) == root / f"iter_{step:07d}"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000003"]


def test_a_full_disk_during_background_writes_says_why_and_keeps_the_previous_checkpoint(small_disk):
    """The shards (256 KiB) no longer fit once the save has started: finishing it raises one line naming the step,
    the directory and ENOSPC; the temporary folder is gone; the previous checkpoint and the tracker stay."""
    root = small_disk / "ckpt"
    model = _Weights(1 << 16)
    assert _save(root, 1, model).finish(blocking=True)
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # room for the metadata, not the shards
    pending = _save(root, 2, model, parent=root / "iter_0000001")
    with pytest.raises(CheckpointWriteError) as caught:
        pending.finish(blocking=True)
    message = str(caught.value)
    assert "\n" not in message
    for part in ("step 2", str(root), "No space left on device", "iter_0000001"):
        assert part in message, (part, message)
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert (root / TRACKER).read_text() == "1\n"
    (small_disk / "filler").unlink()
    latest = find_latest_checkpoint(root)
    assert latest is not None and latest.name == "iter_0000001"


def _writer(pending) -> Any:
    """The save's forked writer (Megatron's TemporalAsyncCaller process)."""
    return pending.queue.async_calls[0].async_caller.process


def test_the_writer_ignores_a_ctrl_c_to_the_process_group(tmp_path):
    """Issue 53, item 1: a terminal's Ctrl-C reaches the writer too, which inherited the trainer's SIGINT handler and
    raised KeyboardInterrupt inside Megatron's write before posting its results (the trainer's wait for them then
    hung, or printed ForkProcess tracebacks). The writer now starts with the stop signals blocked and ignores them:
    SIGINT and SIGTERM sent to it throughout its write change nothing. In-process, about 1 s."""
    import os
    import signal
    import time

    root = tmp_path / "ckpt"
    model = _Weights(1 << 21)  # 8 MiB: a write long enough to be hit
    pending = _save(root, 1, model)
    writer = _writer(pending)
    sent = 0
    while writer.is_alive() and sent < 50:
        try:
            os.kill(writer.pid, signal.SIGINT if sent % 2 == 0 else signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.005)
    assert sent >= 1
    assert pending.finish(blocking=True)
    assert writer.exitcode == 0
    fresh = _Weights(1 << 21)
    load_training_checkpoint(root / "iter_0000001", cast(Any, [fresh]), None)  # checks the fingerprint too
    assert torch.equal(fresh.weight.detach(), model.weight.detach())


def test_a_writer_that_outlasts_the_shutdown_s_bound_is_abandoned_with_one_line(tmp_path):
    """Issue 53, item 1: the shutdown's wait for a save in flight had no bound. A writer stopped (SIGSTOP) for good:
    the bounded wait abandons the save with one line naming the step and the writer, its temporary folder is removed
    and the previous checkpoint stays. In-process, about 2 s."""
    import os
    import signal

    root = tmp_path / "ckpt"
    model = _Weights(1 << 12)
    assert _save(root, 1, model).finish(blocking=True)
    pending = _save(root, 2, model, parent=root / "iter_0000001")
    writer = _writer(pending)
    os.kill(writer.pid, signal.SIGSTOP)
    with pytest.raises(CheckpointWriteError) as caught:
        pending.finish(blocking=True, timeout=1.0)
    message = str(caught.value)
    assert message.startswith(f"--save: step 2's checkpoint writer (pid {writer.pid}) was still writing 1s into")
    assert "\n" not in message and "abandoned" in message
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert (root / TRACKER).read_text() == "1\n"
    writer.join(10)
    assert not writer.is_alive()
