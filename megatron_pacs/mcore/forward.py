"""Megatron's schedule as the one way to run the model: forward steps over micro-batches, and log-probs.

Micro-batches (padded or packed, :class:`~megatron_pacs.algo.tokens.MicroBatch`) come from the step's layout
(:mod:`megatron_pacs.data.layout`); this module runs them through Megatron's ``forward_backward_func`` and turns
each micro-batch's logits into its scored tokens' log-probs (:meth:`MicroBatch.scored`).

Shapes: N sequences, L padded length, b rows, T packed length, Vp = V / TP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, cast, overload

import torch
import torch.distributed as dist
from megatron.core.enums import Fp8Recipe
from megatron.core.fp8_utils import get_fp8_align_size
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_pacs.algo.tokens import MicroBatch, TokenStore, make_micro_batches
from megatron_pacs.mcore.attention import packed_sequences, uses_own_attention
from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.logprobs import LogprobImpl, vocab_parallel_logprobs
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.router_replay import RoutingPass

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "model_token_logprobs",
    "own_routing_report",
    "run_schedule",
    "run_schedule_together",
    "sequence_logprobs",
    "token_alignment",
    "token_logprobs",
]

# (logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report): Megatron's 3-tuple loss convention.
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def token_alignment(config: TransformerConfig) -> int:
    """The multiple a micro-batch's token dimension must be: TP with sequence parallelism (the sequence is split
    over the TP ranks), with FP8 what Transformer Engine's FP8 GEMMs need of both dimensions (megatron-core's
    ``get_fp8_align_size``: 32 for MXFP8, whose scales cover blocks of 32, else 16), their product with both."""
    sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if not config.fp8:
        return sp
    recipe = Fp8Recipe(config.fp8_recipe or Fp8Recipe.delayed)
    return sp * get_fp8_align_size(recipe)  # with both, each rank's T / TP tokens must be aligned


@overload
def model_token_logprobs(
    output: torch.Tensor,
    mb: MicroBatch,
    tp_group: dist.ProcessGroup,
    temperature: float = 1.0,
    *,
    impl: LogprobImpl = "auto",
    entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def model_token_logprobs(
    output: torch.Tensor,
    mb: MicroBatch,
    tp_group: dist.ProcessGroup,
    temperature: float = 1.0,
    *,
    impl: LogprobImpl = "auto",
    entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def model_token_logprobs(
    output: torch.Tensor,
    mb: MicroBatch,
    tp_group: dist.ProcessGroup,
    temperature: float = 1.0,
    *,
    impl: LogprobImpl = "auto",
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[b, L - 1]`` log-prob of ``tokens[:, 1:]`` from the last stage's logits ``[b, L, Vp]`` (``impl``: the
    kernel, ``--logprob-impl``, as :func:`~megatron_pacs.mcore.logprobs.vocab_parallel_logprobs`), and with
    ``entropy`` the ``[b, L - 1]`` entropy of each of those positions' distributions (same pass, differentiable).

    Every position is scored against the next token (the last one against a placeholder, cut off): slicing the
    logits to ``L - 1`` positions instead would copy them (non-contiguous) and make the backward allocate a zeroed
    full-size gradient plus a copy; this way the kernels read the logits in place and write their gradient whole
    (the last position's is 0).
    """
    tokens = mb.tokens.to(output.device)
    labels = torch.roll(tokens, -1, dims=1)  # labels[:, t] = tokens[:, t + 1]; the wrap-around at L - 1 is dropped
    if entropy:
        logp, ent = vocab_parallel_logprobs(
            output, labels, tp_group, temperature=temperature, impl=impl, return_entropy=True
        )
        return logp[:, :-1], ent[:, :-1]
    return vocab_parallel_logprobs(output, labels, tp_group, temperature=temperature, impl=impl)[:, :-1]


def _forward_step_factory(loss_fn: LossFn, routing: RoutingPass | None):
    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        if routing is not None:
            routing.before_forward(model, mb)
        device = next(model.parameters()).device
        tokens = mb.tokens.to(device, non_blocking=True)
        length = tokens.shape[1]
        position_ids = mb.position_ids().to(device, non_blocking=True)
        if mb.seqlens is not None:
            params = packed_sequences(mb.seqlens, length, device, host=uses_own_attention(model))
            output = model(tokens, position_ids, None, packed_seq_params=params)
        else:
            # An explicit causal mask (True = masked): Megatron's default one is allocated on "cuda".
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]
            output = model(tokens, position_ids, causal)
        if routing is not None:
            output = routing.after_forward(model, mb, output)
        return output, lambda output_tensor: loss_fn(output_tensor, mb)

    return forward_step


def run_schedule(
    models: Sequence[MegatronModule],
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run Megatron's forward(-backward) schedule over ``micro_batches``.

    ``loss_fn(logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report)`` runs on the last stage, in
    Megatron's 3-tuple convention.

    Returns:
        On the last pipeline stage, the report dicts of ``loss_fn``, one per micro-batch; ``[]`` elsewhere.
    """
    return _schedule(models, micro_batches, loss_fn, forward_only=forward_only, rows_per_message=1)


def _schedule(
    models: Sequence[torch.nn.Module],
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    rows_per_message: int,
    routing: RoutingPass | None = None,
) -> list[dict[str, torch.Tensor]]:
    replayed = sum(mb.routed_experts is not None for mb in micro_batches)
    if replayed and replayed < len(micro_batches):
        raise ValueError(f"{replayed} of {len(micro_batches)} micro-batches carry a routing: all or none")
    if routing is None and replayed:
        routing = RoutingPass(models)
    seq_length = micro_batches[0].tokens.shape[1]
    mbs = micro_batches[0].tokens.shape[0] * rows_per_message
    if len(models) > 1:  # interleaved: one iterator per model chunk
        data_iterator = [iter(micro_batches) for _ in models]
    else:
        data_iterator = iter(micro_batches)
    if routing is not None:
        routing.clear()
    try:
        with cuda_to_cpu():
            return get_forward_backward_func()(
                forward_step_func=_forward_step_factory(loss_fn, routing),
                data_iterator=data_iterator,
                model=list(models),
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=mbs,
                forward_only=forward_only,
            )
    finally:
        if routing is not None:
            routing.clear()


class _StackedChunks(torch.nn.Module):
    """Chunk i of several models with one parallel layout, run as one stage of one schedule.

    Their activations travel stacked along the batch dimension: hidden states ``[s, n * b, h]`` between pipeline
    stages (the schedule's message shape is told ``n * b`` rows), logits ``[n * b, L, Vp]`` from the last stage,
    model k's rows at ``[k * b, (k + 1) * b)``. Megatron finds ``config`` and ``model_type`` through ``module``,
    the first model's chunk.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        from megatron.core.utils import get_attr_wrapped_model

        self.module = chunks[0]
        self.others = torch.nn.ModuleList(chunks[1:])
        self.last_stage = bool(get_attr_wrapped_model(chunks[0], "post_process"))

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return [self.module, *self.others]

    @staticmethod
    def _method(chunk: torch.nn.Module, name: str) -> Callable[..., None] | None:
        """``chunk``'s (possibly DDP-wrapped) model's method ``name``, or None where it has none."""
        from megatron.core.utils import get_attr_wrapped_model

        try:
            return cast(Callable[..., None], get_attr_wrapped_model(chunk, name))
        except RuntimeError:
            return None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        received = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        parts = [None] * len(self.chunks) if received is None else received.chunk(len(self.chunks), dim=1)
        for chunk, part in zip(self.chunks, parts, strict=True):
            setter = self._method(chunk, "set_input_tensor")
            assert setter is not None, "a Megatron model chunk takes its pipeline input through set_input_tensor"
            setter([part])

    def set_is_first_microbatch(self) -> None:
        # FP8 weight caching: Megatron calls this on the stage's model at each pass's first micro-batch
        for chunk in self.chunks:
            method = self._method(chunk, "set_is_first_microbatch")
            if method is not None:
                method()

    def forward(self, *args, **kwargs) -> torch.Tensor:
        outputs = [chunk(*args, **kwargs) for chunk in self.chunks]
        return torch.cat(outputs, dim=0 if self.last_stage else 1)


def run_schedule_together(
    model_sets: Sequence[Sequence[MegatronModule]], micro_batches: list[MicroBatch], loss_fns: Sequence[LossFn]
) -> None:
    """Several models with the same parallel layout (the actor and the reference) over the same micro-batches in one
    forward-only schedule: one pipeline fill and drain, one pass over the data, each model its own weights.

    Args:
        model_sets: Each model's chunks on this rank (as for :func:`run_schedule`).
        micro_batches: This rank's micro-batches.
        loss_fns: One per model, called on the last stage with that model's ``[b, L, Vp]`` logits shard (their
            reports are dropped: the functions keep what they need).
    """
    if len(model_sets) != len(loss_fns):
        raise ValueError(f"{len(model_sets)} models but {len(loss_fns)} loss functions")
    if len(model_sets) == 1:
        run_schedule(model_sets[0], micro_batches, loss_fns[0], forward_only=True)
        return
    if len({len(chunks) for chunks in model_sets}) != 1:
        raise ValueError("models run together need the same layout (the same number of chunks on this rank)")
    stacked = [_StackedChunks(chunks) for chunks in zip(*model_sets, strict=True)]

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        for fn, part in zip(loss_fns, logits.chunk(len(loss_fns), dim=0), strict=True):
            fn(part, mb)
        return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

    _schedule(stacked, micro_batches, loss_fn, forward_only=True, rows_per_message=len(model_sets))


@torch.no_grad()
def own_routing_report(
    models: Sequence[MegatronModule],
    micro_batches: list[MicroBatch],
    engine: TokenStore,
    tp_group: dist.ProcessGroup,
    *,
    impl: LogprobImpl = "auto",
) -> dict[str, torch.Tensor]:
    """The router-replay metrics of micro-batches that carry the engine's routing (docs/algorithm.md §7.3), from one
    forward-only pass in which the routers choose for themselves, on the same weights:

    - ``moe/router_agreement``: the fraction of the engine's (token, layer, k) choices the router's own top-k holds;
    - ``moe/logprob_abs_diff_mean_without_replay``: per-token |trainer - engine| log-prob at temperature 1 without
      replay (``consistency/logprob_abs_diff_mean`` is the same gap with replay).

    Args:
        models: This rank's model chunks (built with ``moe_enable_routing_replay``).
        micro_batches: This rank's micro-batches, with ``routed_experts``.
        engine: The engines' token log-probs of the step's responses (NaN where none).
        tp_group: Tensor-parallel group (vocab-parallel log-probs).
        impl: The log-prob kernel (``--logprob-impl``).

    Returns:
        ``[value, weight]`` entries of this rank (every rank counts its own layers and tokens: summed over ranks,
        the global fractions and means).
    """
    gap = torch.zeros(2, dtype=torch.float64)

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        scored = mb.scored(model_token_logprobs(logits, mb, tp_group, impl=impl).float())
        given = engine.gather(scored)
        seen = torch.isfinite(given)
        delta = torch.where(seen, scored.logp - given, 0.0).abs()
        gap.add_(torch.stack([delta.sum(), seen.sum()]).double().cpu())
        return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

    for m in models:
        m.eval()
    routing = RoutingPass(models, compare=True)
    _schedule(models, micro_batches, loss_fn, forward_only=True, rows_per_message=1, routing=routing)
    return {
        "moe/router_agreement": torch.tensor([routing.agree, routing.total]),
        "moe/logprob_abs_diff_mean_without_replay": gap.float(),
    }


def _token_logp_loss_fn(tp_group: dist.ProcessGroup, temperature: float, impl: LogprobImpl) -> LossFn:
    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        token_logp = model_token_logprobs(logits, mb, tp_group, temperature, impl=impl)
        count = torch.tensor(token_logp.shape[0], dtype=torch.int, device=token_logp.device)
        return token_logp.sum(), count, {"token_logp": token_logp.detach(), "index": mb.index.to(token_logp.device)}

    return loss_fn


@torch.no_grad()
def token_logprobs(
    models: Sequence[MegatronModule],
    groups: ParallelGroups,
    tokens: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    impl: LogprobImpl = "auto",
) -> torch.Tensor:
    """Log-prob of every token given its prefix, on every rank (forward-only schedule, any TP / PP / VPP).

    Args:
        models: This rank's model chunks.
        groups: Parallel groups.
        tokens: ``[N, L]`` right-padded token ids.
        micro_batch_size: Rows per micro-batch.
        temperature: The sampling temperature the log-probs refer to.
        impl: The log-prob kernel (``--logprob-impl``).

    Returns:
        ``[N, L - 1]`` float32: entry ``t`` is ``log p(tokens[:, t + 1] | tokens[:, :t + 1])``.
    """
    for m in models:
        m.eval()
    length = tokens.shape[1]
    align = token_alignment(models[0].config)
    if length % align:  # padding columns at the end change no earlier log-prob (causal) and are cut off below
        tokens = torch.nn.functional.pad(tokens, (0, align - length % align))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    micro_batches = make_micro_batches(tokens, mask, micro_batch_size)
    loss_fn = _token_logp_loss_fn(groups.tp_group, temperature, impl)
    reports = run_schedule(models, micro_batches, loss_fn, forward_only=True)
    device = next(models[0].parameters()).device
    result = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.float32, device=device)
    if groups.is_last_stage:
        for r in reports:
            keep = r["index"] >= 0
            result[r["index"][keep]] = r["token_logp"][keep].float()
    if groups.pp_size > 1:
        dist.broadcast(result, src=groups.last_stage_global_rank, group=groups.pp_group)
    return result[:, : length - 1]


def sequence_logprobs(
    models: Sequence[MegatronModule],
    groups: ParallelGroups,
    tokens: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    impl: LogprobImpl = "auto",
) -> torch.Tensor:
    """Per-sequence sums of the scored tokens' log-probs, on every rank (arguments as :func:`token_logprobs`).

    Args:
        score_mask: ``[N, L]`` True at the tokens to score (response tokens; position 0 is never scored).

    Returns:
        ``[N]`` float32 sums, identical on all ranks of the model-parallel group.
    """
    if tokens.shape != score_mask.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and score_mask {tuple(score_mask.shape)} must match")
    logp = token_logprobs(models, groups, tokens, micro_batch_size=micro_batch_size, temperature=temperature, impl=impl)
    mask = score_mask[:, 1:].to(logp.device).bool()
    return torch.where(mask, logp, torch.zeros_like(logp)).sum(-1)
