"""The Megatron actor: log-probs of rollouts, and updates through Megatron's forward-backward schedule.

The actor knows nothing of the objective: :meth:`Actor.optimizer_step` takes a micro-batch loss from
:mod:`megatron_pacs.algo.objectives` (token log-probs in, Megatron's ``(loss_sum, count, report)`` out) and wraps it
with the vocab-parallel log-probs of the last stage's logits. The model is built with ``calculate_per_token_loss``,
so the gradient is ``sum over the global mini-batch / global count`` (docs/algorithm.md §4), independent of
micro-batching, DP size and pipeline schedule.

Legend: b rows per micro-batch, L padded length, Vp vocabulary shard, S responses of the step, R_i response i's
length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from megatron_pacs.algo.objectives import Logprobs, MicroBatchLoss
from megatron_pacs.algo.tokens import MicroBatch, TokenLogprobs, TokenStore
from megatron_pacs.config import ModelConfig, OptimConfig
from megatron_pacs.mcore.forward import (
    model_token_logprobs,
    own_routing_report,
    run_schedule_together,
    token_alignment,
    token_logprobs,
)
from megatron_pacs.mcore.logprobs import LogprobImpl
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.optim import (
    StepResult,
    Trainable,
    build_trainable,
    offload_trainable,
    onload_trainable,
    optimizer_step,
)
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import MegatronModule

__all__ = ["Actor", "build_chunks", "policy_logprobs"]


def build_chunks(model: ModelConfig, groups: ParallelGroups, hf_config: Any) -> list[GPTModel]:
    """This rank's chunks of a model of ``hf_config``'s shape with ``model``'s settings (dtype, recompute, spec,
    fusions, FP8, MoE, determinism), random weights; the actor's, the reference's and the critic's builder."""
    return build_gpt_model(
        hf_config,
        groups,
        dtype=torch.bfloat16 if model.bf16 else torch.float32,
        recompute=model.recompute_activations,
        spec=model.transformer_impl,
        fusions=model.fusions,
        calculate_per_token_loss=True,
        deterministic_mode=model.deterministic_mode,
        **(model.fp8 or {}),
        **model.moe,
    )


class Actor:
    """This rank's model chunks, built from ``model.hf_model`` (weights loaded exactly), with their optimizer.

    Args:
        model: The model settings (HF directory, dtype, FP8, recompute, layer implementation).
        groups: Parallel groups.
        optim: Optimizer settings; None builds a frozen model (a reference policy) without DDP or optimizer.
    """

    def __init__(self, model: ModelConfig, groups: ParallelGroups, optim: OptimConfig | None) -> None:
        from transformers import AutoConfig

        self.groups = groups
        self.logprob_impl: LogprobImpl = cast(LogprobImpl, model.logprob_impl)  # validated by ModelConfig
        self.hf_config = AutoConfig.from_pretrained(model.hf_model)
        self.models = build_chunks(model, groups, self.hf_config)
        load_hf_weights(self.models, model.hf_model, groups, self.hf_config)
        self.trainable: Trainable | None = None
        if optim is not None:
            self.trainable = build_trainable(self.models, groups, optim)
        else:
            for p in (p for m in self.models for p in m.parameters()):
                p.requires_grad_(False)

    @property
    def fp8(self) -> bool:
        """The model trains with FP8 (Transformer Engine)."""
        return bool(self.models[0].config.fp8)

    @contextmanager
    def fp8_passes(self, enabled: bool) -> Iterator[None]:
        """FP8 on (as built) or off (bf16) for the passes inside. Megatron decides per forward from
        ``TransformerConfig.fp8``, and a pass outside FP8 leaves the delayed recipe's amax history alone."""
        if enabled or not self.fp8:
            yield
            return
        configs: list[Any] = list({id(m.config): m.config for m in self.models}.values())
        saved = [(c, c.fp8) for c in configs]
        for c in configs:
            c.fp8 = None
        try:
            yield
        finally:
            for c, value in saved:
                c.fp8 = value

    @property
    def token_alignment(self) -> int:
        """The multiple every micro-batch's token dimension must be (see ``forward.token_alignment``)."""
        return token_alignment(self.models[0].config)

    @property
    def chunks(self) -> Sequence[MegatronModule]:
        return list(self.trainable.models) if self.trainable is not None else self.models

    # -- forward-only ----------------------------------------------------------------------------------------

    def logprobs(
        self,
        micro_batches: list[MicroBatch],
        response_lens: torch.Tensor,
        *,
        temperature: float = 1.0,
        tokens: bool = False,
        fp8: bool = True,
    ) -> Logprobs:
        """Sequence (and optionally token) log-probs of the micro-batches' responses, on every rank.

        Args:
            micro_batches: This rank's micro-batches (padded or packed).
            response_lens: ``[S]`` response lengths of the step (the token store's layout).
            temperature: The sampling temperature the log-probs refer to.
            tokens: Also keep every response token's log-prob (last pipeline stage).
            fp8: For an FP8 model: run this pass in FP8 (as built) or, with False, in bf16.

        Returns:
            ``Logprobs(seq [S] float64, tokens)``: ``seq[i]`` is response i's log-likelihood (0 for responses not
            in the micro-batches), identical on every rank of the model-parallel group; ``tokens`` holds response
            i's ``[R_i]`` token log-probs on the last stage when asked for.
        """
        (out,) = policy_logprobs(
            [self], micro_batches, response_lens, temperature=temperature, tokens=[tokens], fp8=fp8
        )
        return out

    def routing_report(self, micro_batches: list[MicroBatch], engine: TokenStore) -> dict[str, torch.Tensor]:
        """Router replay's metrics on micro-batches that carry the engine's routing: the routers' agreement with it
        and the engine log-prob gap without replay (:func:`~megatron_pacs.mcore.forward.own_routing_report`; one
        forward-only pass)."""
        return own_routing_report(self.chunks, micro_batches, engine, self.groups.tp_group, impl=self.logprob_impl)

    def probe_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every token's log-prob at temperature 1 in the precision the engines run (bf16 even for an FP8 model:
        an FP8 pass would add FP8's own gap, docs/algorithm.md §7.2); the weight-sync probe's side of the trainer.

        Args:
            tokens: ``[N, L]`` right-padded token ids (one micro-batch).

        Returns:
            ``[N, L - 1]`` float32 on every rank of the model-parallel group: entry ``t`` is
            ``log p(tokens[:, t + 1] | tokens[:, :t + 1])``.
        """
        with self.fp8_passes(False):
            return token_logprobs(
                self.chunks, self.groups, tokens, micro_batch_size=tokens.shape[0], impl=self.logprob_impl
            )

    # -- training ----------------------------------------------------------------------------------------------

    def optimizer_step(
        self,
        micro_batches: list[MicroBatch],
        loss: MicroBatchLoss,
        *,
        temperature: float = 1.0,
        raw_logprobs: bool = False,
        entropy_grad: bool = False,
    ) -> StepResult:
        """One optimizer step over this rank's micro-batches of a mini-batch (collective over all ranks).

        Every micro-batch's pass also computes its tokens' entropies (``TokenLogprobs.entropy``, no extra read of the
        logits) and reports their token mean, ``actor/entropy``.

        Args:
            micro_batches: This rank's share of the mini-batch (padded or packed).
            loss: An objective's micro-batch loss (:class:`megatron_pacs.algo.objectives.Prepared`).
            temperature: The sampling temperature the log-probs refer to.
            raw_logprobs: Also hand the loss the tokens' log-probs at temperature 1 (``TokenLogprobs.raw``, what
                the engines report; one more vocabulary pass when the temperature is not 1).
            entropy_grad: The loss differentiates the entropies (an entropy bonus); otherwise they are detached and
                the backward costs what it did without them.
        """
        if self.trainable is None:
            raise ValueError("this Actor is frozen (built without an OptimConfig) and cannot train")
        tp_group, impl = self.groups.tp_group, self.logprob_impl

        def loss_fn(logits: torch.Tensor, mb: MicroBatch):
            logp, entropy = model_token_logprobs(logits, mb, tp_group, temperature, impl=impl, entropy=True)
            scored: TokenLogprobs = mb.scored(logp, entropy if entropy_grad else entropy.detach())
            assert scored.entropy is not None  # handed to scored() above
            flat_entropy = scored.entropy.detach().float()
            if raw_logprobs:
                raw = (
                    logp if temperature == 1.0 else model_token_logprobs(logits.detach(), mb, tp_group, 1.0, impl=impl)
                )
                scored.raw = mb.scored(raw.detach()).logp
            loss_sum, count, report = loss(scored)
            n = flat_entropy.new_tensor(float(flat_entropy.numel()))
            return loss_sum, count, {**report, "actor/entropy": torch.stack([flat_entropy.sum(), n])}

        return optimizer_step(self.trainable, micro_batches, loss_fn)

    # -- colocation ------------------------------------------------------------------------------------------

    def offload_training_state(self) -> None:
        """Optimizer state and gradient buffers to host memory (Megatron's RL offload; GPU only, else a no-op)."""
        if self.trainable is not None:
            offload_trainable(self.trainable)

    def onload_training_state(self) -> None:
        """Undo :meth:`offload_training_state` before an update."""
        if self.trainable is not None:
            onload_trainable(self.trainable)

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the current weights under HF names (every rank must iterate to the end)."""
        return export_hf_weights(self.models, self.groups, self.hf_config)


@torch.no_grad()
def policy_logprobs(
    policies: Sequence[Actor],
    micro_batches: list[MicroBatch],
    response_lens: torch.Tensor,
    *,
    temperature: float,
    tokens: Sequence[bool],
    fp8: bool = True,
) -> list[Logprobs]:
    """Several policies' log-probs of the same micro-batches (the actor's old and the reference's), in one
    forward-only schedule (:func:`~megatron_pacs.mcore.forward.run_schedule_together`): one pipeline fill and drain
    and one pass over the data for all of them.

    Args:
        policies: Models with the same parallel layout.
        micro_batches, response_lens, temperature, fp8: As :meth:`Actor.logprobs`.
        tokens: Per policy, whether to keep the token log-probs too.

    Returns:
        One ``Logprobs`` per policy, as :meth:`Actor.logprobs` returns.
    """
    if len(policies) != len(tokens):
        raise ValueError(f"{len(policies)} policies but {len(tokens)} token flags")
    groups = policies[0].groups
    device = next(policies[0].models[0].parameters()).device
    seqs = [torch.zeros(response_lens.numel(), dtype=torch.float64, device=device) for _ in policies]
    stores = [TokenStore.zeros(response_lens, device) if keep else None for keep in tokens]

    def collect(seq_logp: torch.Tensor, store: TokenStore | None, impl: LogprobImpl):
        def loss_fn(logits: torch.Tensor, mb: MicroBatch):
            scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group, temperature, impl=impl).float())
            sums = scored.sequence_sums()
            seq_logp[scored.index] = sums
            if store is not None:
                store.put(scored, scored.logp)
            return sums.sum().float(), torch.tensor(1, dtype=torch.int), {}

        return loss_fn

    for policy in policies:
        for m in policy.chunks:
            m.eval()
    with ExitStack() as precision:
        for policy in policies:
            precision.enter_context(policy.fp8_passes(fp8))
        run_schedule_together(
            [p.chunks for p in policies],
            micro_batches,
            [collect(q, t, p.logprob_impl) for q, t, p in zip(seqs, stores, policies, strict=True)],
        )
    if groups.pp_size > 1:
        for seq_logp in seqs:
            dist.broadcast(seq_logp, src=groups.last_stage_global_rank, group=groups.pp_group)
    return [Logprobs(q, t) for q, t in zip(seqs, stores, strict=True)]
