"""Training checkpoints on a real single-rank gloo group (Megatron's distributed checkpointing, no model): which
checkpoint a resume takes after a rollback, ``--keep-last`` in write order, corrupt metadata, and the RNG state
loaded without running pickled code."""

import json
import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist

from megatron_pacs.mcore.cpu_support import apply_cpu_support
from megatron_pacs.mcore.training_checkpoint import (
    TRACKER,
    find_latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)


@pytest.fixture(scope="module", autouse=True)
def gloo_group():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    apply_cpu_support()
    yield
    dist.destroy_process_group()


def save(root, step, keep_last=2):
    return save_training_checkpoint(root, step, [], None, {"branch": "any"}, keep_last=keep_last)


def steps(root):
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_"))


def test_resume_after_a_rollback_takes_the_checkpoint_written_last(tmp_path):
    """Issue 24.4: steps 20 and 40 saved, then a rollback to 20 saves 30. The highest step (40) is the diverged
    branch: the tracker names 30, and --keep-last deletes in write order (40 before 30)."""
    save(tmp_path, 20)
    save(tmp_path, 40)
    save(tmp_path, 30)  # the new branch, after --load .../iter_0000020
    assert (tmp_path / TRACKER).read_text() == "30\n"
    assert steps(tmp_path) == [30, 40]
    assert find_latest_checkpoint(tmp_path).name == "iter_0000030"
    save(tmp_path, 35, keep_last=1)
    assert steps(tmp_path) == [35] and find_latest_checkpoint(tmp_path).name == "iter_0000035"


def test_keep_last_one_after_a_rollback_keeps_the_new_branch(tmp_path):
    save(tmp_path, 20, keep_last=1)
    save(tmp_path, 40, keep_last=1)
    save(tmp_path, 10, keep_last=1)
    assert steps(tmp_path) == [10] and find_latest_checkpoint(tmp_path).name == "iter_0000010"


@pytest.mark.parametrize("content", ["", "{", "[1, 2]"])
def test_empty_or_corrupt_metadata_falls_back_with_a_warning(tmp_path, caplog, content):
    save(tmp_path, 1)
    latest = save(tmp_path, 2)
    (latest / "megatron_pacs.json").write_text(content)  # a crash between open() and the write, a bad disk
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        assert find_latest_checkpoint(tmp_path).name == "iter_0000001"
    assert "iter_0000002" in caplog.text and "corrupt" in caplog.text
    with pytest.raises(ValueError, match=r"--load: .*empty or corrupt"):
        load_training_checkpoint(latest, [], None)
    meta = load_training_checkpoint(find_latest_checkpoint(tmp_path), [], None)
    assert meta["step"] == 1 and meta["branch"] == "any"


def test_corrupt_tracker_falls_back_to_the_checkpoint_written_last(tmp_path, caplog):
    save(tmp_path, 5)
    save(tmp_path, 3)
    (tmp_path / TRACKER).write_text("not a step")
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        assert find_latest_checkpoint(tmp_path).name == "iter_0000003"
    assert TRACKER in caplog.text
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary file left behind


class _RunsCodeOnLoad:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_rng_state_loads_without_running_pickled_code(tmp_path, monkeypatch):
    """Issue 24.8: the RNG file is loaded with ``weights_only=True``; a pickle that runs code is refused."""
    monkeypatch.chdir(tmp_path)
    ckpt = save(tmp_path, 1)
    good = torch.load(ckpt / "rng_rank00000.pt", weights_only=True)
    assert set(good) == {"python", "torch", "cuda"}
    torch.save({"python": _RunsCodeOnLoad()}, ckpt / "rng_rank00000.pt")
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        load_training_checkpoint(ckpt, [], None)
    assert not (tmp_path / "pwned").exists()
    assert json.loads((ckpt / "megatron_pacs.json").read_text())["step"] == 1
