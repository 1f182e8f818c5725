"""Weight-sync plumbing without vLLM: buckets, packing, the tied output layer, a broadcast side group, chunking."""

import io
import multiprocessing as mp

import pytest
import torch

from megatron_pacs.rollout.sync import (
    add_tied_lm_head,
    broadcast_buffer,
    iter_buckets,
    pack_bucket,
    standalone_group,
    unpack_bucket,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 6, generator=g).t()),  # non-contiguous
        ("model.norm.weight", torch.randn(5, generator=g).double()),
        ("counter", torch.arange(3, dtype=torch.int64)),
    ]


def test_pack_unpack_round_trip_is_bitwise_for_mixed_dtypes_and_layouts():
    named = _tensors()
    buffer, metas = pack_bucket(named)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert all(m.offset % 16 == 0 for m in metas)
    out = unpack_bucket(buffer, metas)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_buckets_respect_the_size_and_keep_order():
    named = [(f"t{i}", torch.zeros(25)) for i in range(10)]  # 100 bytes each
    buckets = list(iter_buckets(iter(named), bucket_bytes=250))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    big = list(iter_buckets([("big", torch.zeros(1000)), ("s", torch.zeros(1))], bucket_bytes=10))
    assert [[n for n, _ in b] for b in big] == [["big"], ["s"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named, 0))


def test_tied_lm_head_is_added_once_after_the_embedding():
    emb = torch.ones(2, 2)
    named = [("model.embed_tokens.weight", emb), ("model.norm.weight", torch.ones(2))]
    tied = list(add_tied_lm_head(named, tied=True))
    assert [n for n, _ in tied] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert tied[1][1] is emb
    assert [n for n, _ in add_tied_lm_head(named, tied=False)] == [n for n, _ in named]
    explicit = [("lm_head.weight", emb), *named]
    assert [n for n, _ in add_tied_lm_head(explicit, tied=True)].count("lm_head.weight") == 1


def _receiver(port, rank, world, metas, nbytes, queue):
    group = standalone_group("gloo", "127.0.0.1", port, rank, world, timeout_s=60)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    broadcast_buffer(group, buffer, src=0)
    # as bytes: a tensor in a queue travels as a file descriptor that this process serves until it exits, and it
    # exits next (a clean-clone run's parent met the server gone: FileNotFoundError)
    out = io.BytesIO()
    torch.save([(n, t.clone()) for n, t in unpack_bucket(buffer, metas)], out)
    queue.put(out.getvalue())


def test_broadcast_side_group_delivers_the_bucket_to_every_receiver():
    """The disaggregated GPU transport's logic (NCCL there) on gloo: trainer rank 0 broadcasts a packed bucket."""
    from megatron_pacs.utils.launch import free_port

    named = _tensors()
    buffer, metas = pack_bucket(named)
    port, world = free_port(), 3
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, r, world, metas, buffer.numel(), queue)) for r in (1, 2)]
    for p in procs:
        p.start()
    group = standalone_group("gloo", "127.0.0.1", port, 0, world, timeout_s=60)
    broadcast_buffer(group, buffer, src=0)
    got = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for received in (torch.load(io.BytesIO(data), weights_only=True) for data in got):
        for (n, a), (m, b) in zip(named, received, strict=True):
            assert n == m and torch.equal(a, b)


def test_sampling_config_validation_names_the_field():
    from megatron_pacs.rollout.types import SamplingConfig

    for kwargs, field in [
        ({"n": 0}, "n="),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingConfig(**kwargs)


def test_ipc_handle_is_plain_msgpack_data_and_rebuilds_the_same_cuda_tensor_simulated(monkeypatch):
    """On a simulated GPU (CUDA IPC needs a GPU): on CUDA, vLLM carries ``collective_rpc`` arguments
    between processes with msgpack, which refuses ``reduce_tensor``'s raw output (a function, torch classes and
    dtypes). ``ipc_handle`` sends plain values instead; after vLLM's own encoder and decoder, ``rebuild_ipc`` calls
    torch's ``rebuild_cuda_tensor`` with exactly what ``reduce_tensor`` produced, on the receiver's device index."""
    import torch.multiprocessing.reductions as reductions
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from megatron_pacs.rollout import sync

    buffer = torch.zeros(4096, dtype=torch.uint8)
    # what reduce_tensor returns for a CUDA buffer (rebuild_cuda_tensor's parameters, torch's order)
    raw_args = (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        3,
        b"\x01cuda-ipc-handle",
        8192,
        512,
        False,
        b"refcount-handle",
        16,
        b"event-handle",
        True,
    )
    rebuilt = []
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, raw_args))
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: rebuilt.append(a) or "mapped")
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    with pytest.raises(TypeError):
        encoder.encode((reductions.reduce_tensor(buffer),))  # the defect: what the engine was sent before
    handle = sync.ipc_handle(buffer)
    received = decoder.decode(encoder.encode((handle,)))[0]
    assert sync.rebuild_ipc(received, device=0) == "mapped"
    (args,) = rebuilt
    assert args[:6] == (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8)
    assert args[6] == 0  # the receiver's own index of the same GPU, not the sender's 3
    assert args[7:] == raw_args[7:]
    with pytest.raises(ValueError, match=r"packed \[B\] uint8 buffer"):
        sync.ipc_handle(torch.zeros(2, 2))


def test_close_group_leaves_gloo_alone_and_aborts_other_backends():
    """After an engine restart the trainer drops its side group; an NCCL communicator with a dead member
    is aborted (its next collective would hang), a gloo one is just dropped."""
    from megatron_pacs.rollout.sync import SideGroup, close_group, standalone_group
    from megatron_pacs.utils.launch import free_port

    calls = []
    nccl_like = type("Backend", (), {"abort": lambda self: calls.append("abort")})()
    close_group(SideGroup(nccl_like, None, 0, 2))  # type: ignore[arg-type]
    assert calls == ["abort"]
    close_group(standalone_group("gloo", "127.0.0.1", free_port(), 0, 1))
    close_group(None)


def _map_and_write(handle, queue) -> None:
    """Another process: map the sender's buffer from its plain-value handle, check it, and write into it."""
    from megatron_pacs.rollout import sync

    mapped = sync.rebuild_ipc(handle, device=0)
    queue.put(mapped[:8].tolist())
    mapped[:4] = 7  # the sender sees this: the two processes share one allocation
    torch.cuda.synchronize()
    queue.put("written")


@pytest.mark.gpu
def test_gpu_ipc_handles_map_the_senders_buffer_in_another_process():
    """CUDA IPC without vLLM (the colocated weight sync's transport): a packed buffer's handle, sent as plain
    values to a second process on the same GPU, maps the very same memory there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (CUDA IPC maps one process's GPU memory in another)")
    from megatron_pacs.rollout import sync

    buffer = torch.arange(64, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_map_and_write, args=(sync.ipc_handle(buffer), queue))
    proc.start()
    try:
        assert queue.get(timeout=120) == list(range(8))
        assert queue.get(timeout=60) == "written"
        assert buffer[:4].tolist() == [7, 7, 7, 7] and buffer[4:8].tolist() == [4, 5, 6, 7]
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
