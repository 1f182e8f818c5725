"""Rollouts from the driver to the trainer ranks, as tensors: each data-parallel rank receives only its share.

(Not to be confused with the weight-sync transports of :mod:`megatron_pacs.rollout.sync`, which move weights the
other way, from the trainer to the engines.)

The driver (global rank 0) holds the step's :class:`~megatron_pacs.data.batching.RolloutBatch`. One collective
call (:func:`distribute_rollouts`, every rank joins) moves it:

1. **Metadata to every rank** (three broadcasts of ``[S]``-sized tensors: lengths, rewards, a header). Every rank
   then computes every data-parallel rank's share (:func:`~megatron_pacs.data.layout.rank_rows`, from the same
   function of the lengths as the update's layout), so no rank lists are sent.
2. **Tokens to each data-parallel rank's leader** (its model-parallel group's first member): the share's
   sequences as one flat int32 tensor, and its engine log-probs as one float32 tensor, point to point from the
   driver (which is the leader of data-parallel rank 0).
3. **Within each model-parallel group** the leader broadcasts the share to its TP/PP peers.

No Python objects are pickled on this path (the reference sends the whole step as pickled lists to every rank:
at 1,024 prompts x 8 responses x 8k tokens, ~270 MB per rank per step). Tensors live on the collective's device
(CUDA under NCCL) and land on the host once.

Legend: S responses of the step, T_r tokens of data-parallel rank r's share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pacs.config import BatchConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.layout import rank_rows
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.rollout.lost import FOLLOWER_LINE, RolloutClusterLost

__all__ = ["distribute_rollouts", "send_stop"]

_STOP = -1
"""The header's response count that stops every rank instead (:func:`send_stop`)."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _gather_share(batch: RolloutBatch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Driver side: one share's flat tokens and engine log-probs (NaN-free zeros when the batch has none)."""
    part = batch.share(rows)
    engine = part.engine_logprobs
    if engine is None:
        engine = torch.full((int(part.response_lens[rows].sum()),), float("nan"))
    return part.token_ids.to(torch.int32), engine.float()


def _routing_bytes(batch: RolloutBatch, rows: list[int]) -> torch.Tensor:
    """Driver side: one share's routed experts ``[tokens, layers, k]`` int16 as ``[tokens, layers, 2k]`` bytes."""
    routed = batch.share(rows).routed_experts
    assert routed is not None
    return routed.contiguous().view(torch.uint8)


def distribute_rollouts(batch: RolloutBatch | None, cfg: BatchConfig, groups: ParallelGroups) -> RolloutBatch:
    """Give every rank its data-parallel share of the driver's rollouts (collective over the world).

    Args:
        batch: The step's rollouts on the driver (global rank 0), None elsewhere.
        cfg: Batch settings (the mini-batch size and the packing choice decide the shares).
        groups: This rank's parallel groups (``dp_leaders`` and ``mp_group`` from ``init_parallel``).

    Returns:
        A batch with the step's metadata for all S responses and the tokens (and engine log-probs) of this
        rank's data-parallel share; on the host.
    """
    rank, device = dist.get_rank(), _device()
    # 1. metadata: [S, n, has engine log-probs], then lengths and rewards
    header = torch.zeros(3, dtype=torch.long, device=device)
    if rank == 0:
        assert batch is not None, "the driver (rank 0) holds the rollouts"
        header[:] = torch.tensor([batch.num_responses, batch.group_size, int(batch.engine_logprobs is not None)])
    dist.broadcast(header, src=0)
    num, group_size, has_engine = (int(v) for v in header.tolist())
    if num == _STOP:
        raise RolloutClusterLost(FOLLOWER_LINE)
    lens = torch.zeros(2, num, dtype=torch.long, device=device)
    rewards = torch.zeros(num, dtype=torch.float32, device=device)
    if rank == 0:
        assert batch is not None
        lens[0], lens[1] = batch.prompt_lens.to(device), batch.response_lens.to(device)
        rewards.copy_(batch.rewards.to(device))
    dist.broadcast(lens, src=0)
    dist.broadcast(rewards, src=0)
    # the engine's routing per token (router replay): [layers, k], zeros without; sent as bytes (no int16 in gloo)
    shape = torch.zeros(2, dtype=torch.long, device=device)
    if rank == 0 and batch is not None and batch.routed_experts is not None:
        shape[:] = torch.tensor(batch.routed_experts.shape[1:])
    dist.broadcast(shape, src=0)
    layers, k = shape.tolist()
    routed: torch.Tensor | None = None
    prompt_lens, response_lens, rewards = lens[0].cpu(), lens[1].cpu(), rewards.cpu()
    lengths = (prompt_lens + response_lens).tolist()
    rows = rank_rows(lengths, cfg, group_size, groups.dp_size)
    mine = rows[groups.dp_rank]
    num_tokens = sum(lengths[i] for i in mine)
    num_response_tokens = int(response_lens[mine].sum())
    # 2. the driver sends each other leader its share; leaders receive
    leader = groups.dp_leaders[groups.dp_rank]
    if rank == 0:
        assert batch is not None
        pending = []
        for r, dst in enumerate(groups.dp_leaders):
            if dst == 0:
                continue
            tokens, engine = _gather_share(batch, rows[r])
            pending += [dist.isend(tokens.to(device), dst=dst), dist.isend(engine.to(device), dst=dst)]
            if layers:
                pending.append(dist.isend(_routing_bytes(batch, rows[r]).to(device), dst=dst))
        tokens, engine = (t.to(device) for t in _gather_share(batch, mine))
        if layers:
            routed = _routing_bytes(batch, mine).to(device)
        for work in pending:
            work.wait()
    else:
        tokens = torch.empty(num_tokens, dtype=torch.int32, device=device)
        engine = torch.empty(num_response_tokens, dtype=torch.float32, device=device)
        if layers:
            routed = torch.empty(num_tokens, layers, 2 * k, dtype=torch.uint8, device=device)
        if rank == leader:
            dist.recv(tokens, src=0)
            dist.recv(engine, src=0)
            if routed is not None:
                dist.recv(routed, src=0)
    # 3. the leader passes the share on to its TP/PP peers
    if groups.mp_group is not None and dist.get_world_size(groups.mp_group) > 1:
        dist.broadcast(tokens, src=leader, group=groups.mp_group)
        dist.broadcast(engine, src=leader, group=groups.mp_group)
        if routed is not None:
            dist.broadcast(routed, src=leader, group=groups.mp_group)
    held = torch.zeros(num, dtype=torch.long)
    held[mine] = prompt_lens[mine] + response_lens[mine]
    offsets = torch.zeros(num + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(held, 0)
    return RolloutBatch(
        token_ids=tokens.cpu(),
        offsets=offsets,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        rewards=rewards,
        group_size=group_size,
        engine_logprobs=engine.cpu() if has_engine else None,
        routed_experts=None if routed is None else routed.cpu().view(torch.int16),
    )


def send_stop() -> None:
    """On the driver (a no-op elsewhere): instead of a step's rollouts, tell every rank waiting in
    :func:`distribute_rollouts` to stop (it raises :class:`~megatron_pacs.rollout.lost.RolloutClusterLost` there:
    rank 0 lost the rollout cluster for good, or could not write into --log-dir)."""
    if dist.get_rank() == 0 and dist.get_world_size() > 1:
        dist.broadcast(torch.tensor([_STOP, 0, 0], dtype=torch.long, device=_device()), src=0)
