"""Router replay (R3, ``--router-replay r3``): the MoE routers take the experts the rollout engine chose.

A micro-batch carries the engine's routing (:attr:`MicroBatch.routed_experts`, ``[b, L, layers, k]``, aligned with
its tokens; -1 where the engine gave none: padding and each sequence's last token, whose output no scored log-prob
reads). In every pass of the schedule (the update, the old-policy and the reference passes) :class:`RoutingPass`
hands each router of the model its own slice before the micro-batch's forward: its layer (the router's global layer
number, so any pipeline stage), its sequence-parallel shard (with ``--sequence-parallel`` a router sees
``[L / TP, b]`` tokens, sequence-major) and, where the forward is recomputed in the backward pass (activation
recompute), Megatron's recompute mode, which takes the micro-batches' routings back in order.

Megatron-Core's ``RouterReplay`` objects (one per router, ``moe_enable_routing_replay``) also sit in one
process-wide list, which a second model built in the same process (the reference) extends: this module never uses
that list nor its static methods, it finds each model's own routers by walking the model, and clears them (targets,
the recompute queue and the mode) at the start and end of every pass. Router fusion would bypass the replay
(``moe_router_fusion`` stays off, :func:`~megatron_pacs.mcore.model.moe_settings`).

The same walk measures ``moe/router_agreement`` (:func:`~megatron_pacs.mcore.forward.own_routing_report`): a pass
in which the routers choose for themselves and record it, compared with the engine's choice (docs/algorithm.md
§7.3).

Legend: b rows, L micro-batch length, E experts, k experts per token, n layers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_pacs.algo.tokens import MicroBatch

__all__ = ["RoutingPass", "routers", "routing_shard"]


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The model's routers that can replay (built with ``moe_enable_routing_replay``), in module order."""
    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def _replay(router: TopKRouter) -> RouterReplay:
    replay = router.router_replay
    assert replay is not None
    return replay


def routing_shard(routed: torch.Tensor, layer: int, sp_rank: int, sp_size: int) -> torch.Tensor:
    """One router's slice of a micro-batch's routing, in the order the router sees its tokens.

    Args:
        routed: ``[b, L, n, k]`` expert indices (-1: none given).
        layer: The router's layer, 0-based over the whole model (not the stage).
        sp_rank: This rank's place among the sequence-parallel ranks (its TP rank with ``--sequence-parallel``).
        sp_size: Sequence-parallel ranks (1 without sequence parallelism).

    Returns:
        ``[L / sp_size * b, k]`` long: token ``(s, row)`` of this rank's sequence shard at ``s * b + row``; a token
        without a given routing replays experts ``0..k-1`` (only padding and last tokens, which no scored
        log-prob reads).
    """
    length, k = routed.shape[1], routed.shape[3]
    if length % sp_size:
        raise ValueError(f"a micro-batch of {length} tokens does not split over {sp_size} sequence-parallel ranks")
    part = routed[:, :, layer].transpose(0, 1)  # [L, b, k], as the router's [s, b, h] input
    part = part.chunk(sp_size, dim=0)[sp_rank].reshape(-1, k).long()
    fill = torch.arange(k, device=part.device).expand_as(part)
    return torch.where(part < 0, fill, part)


def _shard_place(router: TopKRouter) -> tuple[int, int]:
    """(sp_rank, sp_size) of the tokens ``router`` sees."""
    if not router.config.sequence_parallel or router.config.tensor_model_parallel_size == 1:
        return 0, 1
    return dist.get_rank(router.tp_group), dist.get_world_size(router.tp_group)


class _EnterBackward(torch.autograd.Function):
    """Identity whose backward switches the routers of one model chunk to Megatron's recompute mode: the gradient
    reaches a chunk's output before its recomputed layers run again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: torch.nn.Module) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx.chunk = chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # pyright: ignore[reportIncompatibleMethodOverride]
        for router in routers(ctx.chunk):
            _replay(router).set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grads[0], None


class RoutingPass:
    """What a model's routers do over one pass of the schedule: replay the micro-batches' routing, or (``compare``)
    choose for themselves and count how often they agree with it.

    Args:
        models: Every model the pass runs (the chunks of the actor, and of the reference when run together).
        compare: Route by the model's own router, recording its choice, and tally the agreement.
    """

    def __init__(self, models: Sequence[torch.nn.Module], *, compare: bool = False) -> None:
        self.models = list(models)
        self.compare = compare
        self.agree = 0.0
        self.total = 0.0

    def _all_routers(self) -> Iterator[TopKRouter]:
        for model in self.models:
            yield from routers(model)

    def clear(self) -> None:
        """Forget every routing and mode of the pass's models (start and end of every pass, so every step)."""
        for router in self._all_routers():
            _replay(router).clear_indices()
            _replay(router).clear_router_replay_action()

    def before_forward(self, chunk: torch.nn.Module, mb: MicroBatch) -> None:
        """Set ``chunk``'s routers for ``mb`` (the same for every model stacked in ``chunk``)."""
        routed = mb.routed_experts
        for router in routers(chunk):
            replay = _replay(router)
            if routed is None:
                replay.clear_router_replay_action()
                continue
            if self.compare:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
                continue
            assert router.layer_number is not None
            sp_rank, sp_size = _shard_place(router)
            device = router.weight.device
            replay.set_target_indices(routing_shard(routed.to(device), router.layer_number - 1, sp_rank, sp_size))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: torch.nn.Module, mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
        """The chunk's output, marked so that its backward recomputes with the replayed routing; in a comparison,
        this micro-batch's agreement is counted here."""
        routed = mb.routed_experts
        if routed is None:
            return output
        if self.compare:
            self._tally(chunk, routed)
            return output
        if output.requires_grad and any(r.config.recompute_granularity for r in routers(chunk)):
            return _EnterBackward.apply(output, chunk)  # pyright: ignore[reportReturnType]
        return output

    def _tally(self, chunk: torch.nn.Module, routed: torch.Tensor) -> None:
        for router in routers(chunk):
            own = _replay(router).get_recorded_indices()
            assert own is not None and router.layer_number is not None
            sp_rank, sp_size = _shard_place(router)
            given = routed[:, :, router.layer_number - 1].transpose(0, 1).chunk(sp_size, dim=0)[sp_rank]
            given = given.reshape(-1, given.shape[-1]).to(own.device).long()
            agree, total = routing_agreement(own, given)
            self.agree += agree
            self.total += total


def routing_agreement(own: torch.Tensor, given: torch.Tensor) -> tuple[float, float]:
    """How many of the given expert choices the router made too.

    Args:
        own: ``[N, k]`` the router's own top-k experts.
        given: ``[N, k]`` the engine's experts (-1: none given; those tokens are not counted).

    Returns:
        (agreeing choices, counted choices): a choice agrees when the router's own set for that token holds it,
        whatever the order.
    """
    counted = (given >= 0).all(-1)
    same = (given[:, :, None] == own[:, None, :]).any(-1)  # [N, k]
    return float(same[counted].sum()), float(counted.sum() * given.shape[-1])
