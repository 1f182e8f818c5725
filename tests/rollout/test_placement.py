"""Where the fleet's work goes: chunks of prompts, the GPUs a local Ray may hand out, Ray's temp folder."""

import os

import pytest

from megatron_pacs.rollout.placement import balance_chunks, local_engine_gpus, short_temp_dir, visible_devices


def test_balance_chunks_spreads_cost_and_covers_every_item():
    costs = [100, 1, 1, 1, 50, 50, 2, 3]
    chunks = balance_chunks(costs, 3)
    assert sorted(i for c in chunks for i in c) == list(range(len(costs)))
    assert all(c == sorted(c) for c in chunks)
    loads = sorted(sum(costs[i] for i in c) for c in chunks)
    assert loads[-1] == 100  # the big item alone; the others share the rest
    assert balance_chunks([1.0, 2.0], 8) == [[1], [0]] or len(balance_chunks([1.0, 2.0], 8)) == 2
    assert balance_chunks([5.0], 0) == [[0]]


def test_local_engines_get_the_gpus_no_trainer_rank_uses():
    """A single-node run without --colocate keeps its engines off the trainer's GPUs: the local Ray sees only the
    GPUs after the local ranks' (local rank r trains on device r), so engine 0 never lands on trainer rank 0's GPU;
    colocated engines get exactly rank 0's device; too few is refused naming the flags."""

    def gpus(ranks, needed, visible=None, count=8, colocate=False, current=0, share=False):
        return local_engine_gpus(
            visible=visible,
            device_count=count,
            local_trainer_ranks=ranks,
            colocate=colocate,
            current_device=current,
            needed=needed,
            share=share,
        )

    assert gpus(4, 4) == ["4", "5", "6", "7"]
    assert gpus(6, 1) == ["6", "7"]
    with pytest.raises(ValueError, match=r"needs 4 GPU\(s\).*2 of 8 visible.*--nproc-per-node"):
        gpus(6, 4)
    # CUDA_VISIBLE_DEVICES names the physical GPUs (indices or UUIDs) the process numbers 0..n-1
    assert gpus(2, 2, visible="GPU-a, GPU-b,GPU-c,GPU-d", count=4) == ["GPU-c", "GPU-d"]
    assert gpus(4, 1, visible="4,5,6,7", count=4, colocate=True) == ["4"]  # rank 0's GPU: its IPC handles live there
    with pytest.raises(ValueError, match=r"rank 0's GPU"):
        gpus(4, 2, visible="4,5,6,7", count=4, colocate=True)
    # a one-GPU machine: an engine shares rank 0's GPU only with its memory share given (--gpu-memory-utilization)
    assert gpus(1, 1, count=1, share=True) == ["0"]
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization \(one engine of one GPU then shares"):
        gpus(1, 1, count=1)
    assert gpus(1, 1, count=2, share=True) == ["1"]  # a GPU left: not shared


def test_visible_devices_sets_the_variable_inside_the_block_only(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with visible_devices(["2", "3"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError), visible_devices(["1"]):
        raise RuntimeError  # restored on the way out of a failure too
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with visible_devices(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_short_temp_dir_stays_in_the_run_dir_unless_socket_paths_would_be_too_long():
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="r", dir="/tmp")
    try:
        assert short_temp_dir(short) == os.path.join(short, "ray") and os.path.isdir(os.path.join(short, "ray"))
        deep = os.path.join(short, "d" * 60)
        got = short_temp_dir(deep)
        assert not got.startswith(deep) and os.path.isdir(got)
        os.rmdir(got)
    finally:
        shutil.rmtree(short)
