"""PPO's critic: a Megatron-Core ``GPTModel`` whose LM head is a one-output value head, with its own optimizer.

Built like the actor (:func:`~megatron_pacs.mcore.actor.build_chunks`, on the actor's TP/PP/VPP layout and
settings) from ``--critic-hf-model`` (default ``--hf-model``), with three differences:

- **the value head** (:class:`ValueHead`) replaces ``output_layer`` on the last pipeline stage: ``[h] -> [1]``,
  weight and bias zero (unless the checkpoint is an exported critic, :func:`export_critic_hf_weights`, whose
  ``score`` head it loads), so every first value is exactly 0 (a fresh head's wild first values gave NaN losses in verl
  #498) while the head's own gradient is not (it is the hidden state times dL/dv); the trunk starts learning from
  the second optimizer step, once the head's weight has moved. Its input is the final norm's output; under sequence
  parallelism each TP rank scores its own slice of the sequence, and only the ``[s, b, 1]`` values are gathered
  (a backward split, not a reduce-scatter: every TP rank computes the same loss);
- **untied embeddings**: a checkpoint that ties them still builds with ``share_embeddings_and_output_weights`` off,
  so no embedding gradient is all-reduced between the first and the last stage over a head that no longer exists
  (verl PR #6105: a critic that hangs under pipeline parallelism with tied embeddings);
- **its own optimizer**: ``--critic-lr``, ``--critic-weight-decay``, ``--critic-clip-grad`` and the actor's schedule
  and Adam settings (:func:`critic_optim`).

Values are read with the log-probs' offset: V(s_t) of response token t is the head's output at position t - 1,
the state before the token was chosen (the last prompt token for t = 0), so :meth:`MicroBatch.scored` on the
``[b, L - 1]`` outputs gives one value per scored token, in the layout of the log-probs (verl #1758 was a one-token
mask offset between the values and the loss). tests/mcore/test_critic.py guards it.

Legend: b rows, L padded length, s sequence, h hidden size, S responses of the step, R_i response i's length.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from megatron_pacs.algo.objectives import MicroBatchLoss
from megatron_pacs.algo.tokens import MicroBatch, TokenStore
from megatron_pacs.config import ModelConfig, OptimConfig
from megatron_pacs.config.critic import CriticConfig
from megatron_pacs.mcore.actor import build_chunks
from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.forward import run_schedule
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
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "HEAD_PREFIX",
    "Critic",
    "ValueHead",
    "attach_value_heads",
    "critic_optim",
    "export_critic_hf_weights",
    "is_token_classifier",
    "token_classification_config",
    "untied",
]

HEAD_PREFIX = "output_layer."
"""The value head's parameter names start with this (the LM head's place); no HF tensor is loaded into it."""


class ValueHead(torch.nn.Module):
    """``[s, b, h] -> ([s, b, 1] float32, None)``, in place of ``GPTModel.output_layer`` (see the module docstring).

    Args:
        config: The model's ``TransformerConfig`` (hidden size, dtype, sequence parallelism).
        tp_group: The tensor-parallel group (the sequence-parallel gather).
    """

    def __init__(self, config: TransformerConfig, tp_group: Any) -> None:
        super().__init__()
        # named as the LM head's (output_layer.weight / .bias): Megatron's sharded state dict expects those keys
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_group = tp_group
        if self.sequence_parallel:
            # each TP rank sees its own sequence slice: finalize_model_grads sums these over TP (Megatron's tag)
            for p in (self.weight, self.bias):
                p.sequence_parallel = True  # pyright: ignore[reportAttributeAccessIssue]

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output  # GPTModel's output-layer call; the head has its own weight
        values = torch.nn.functional.linear(hidden, self.weight, self.bias).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, False, self.tp_group)
        return values, None


def is_token_classifier(hf_config: Any) -> bool:
    """``hf_config`` is an exported critic's (:func:`token_classification_config`): one label, a ``score`` head."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(a.endswith("ForTokenClassification") for a in architectures) and hf_config.num_labels == 1


def untied(hf_config: Any) -> Any:
    """A copy of ``hf_config`` with ``tie_word_embeddings`` off (the critic's build and export config)."""
    out = copy.deepcopy(hf_config)
    out.tie_word_embeddings = False
    return out


def attach_value_heads(chunks: list[GPTModel], groups: ParallelGroups) -> list[GPTModel]:
    """Replace the LM head of the last stage's chunk by a :class:`ValueHead` (chunks built from an
    :func:`untied` config); returns ``chunks``."""
    for chunk in chunks:
        if chunk.post_process:
            head = ValueHead(chunk.config, groups.tp_group).to(next(chunk.parameters()).device)
            chunk.output_layer = head  # pyright: ignore[reportAttributeAccessIssue] - GPTModel calls it alike
    return chunks


def critic_optim(actor: OptimConfig, critic: CriticConfig) -> OptimConfig:
    """The critic's optimizer settings: the actor's schedule, Adam and sharding with the critic's rate, decay and
    clip."""
    return replace(
        actor, lr=critic.critic_lr, weight_decay=critic.critic_weight_decay, clip_grad=critic.critic_clip_grad
    )


class Critic:
    """This rank's chunks of the value model, loaded from the critic's HF checkpoint, with their optimizer.

    Args:
        model: The actor's model settings (dtype, recompute, spec, FP8, determinism); ``hf_model`` is the default
            checkpoint.
        critic: The critic's settings (checkpoint, optimizer).
        groups: The actor's parallel groups.
        optim: The actor's optimizer settings (schedule and Adam; see :func:`critic_optim`).
    """

    def __init__(self, model: ModelConfig, critic: CriticConfig, groups: ParallelGroups, optim: OptimConfig) -> None:
        from transformers import AutoConfig

        self.groups = groups
        self.hf_dir = critic.critic_hf_model or model.hf_model
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        self.models = attach_value_heads(build_chunks(model, groups, untied(self.hf_config)), groups)
        trained = is_token_classifier(self.hf_config)
        # a tied checkpoint holds no lm_head, and an exported critic none either: the trunk is checked as a tied one's
        trunk = copy.deepcopy(self.hf_config)
        trunk.tie_word_embeddings = bool(trunk.tie_word_embeddings) or trained
        load_hf_weights(self.models, self.hf_dir, groups, trunk, skip=(HEAD_PREFIX,))
        if trained:  # an exported critic (export_critic_hf_weights) resumes with its own value head
            self._load_head()
        self.trainable: Trainable = build_trainable(self.models, groups, critic_optim(optim, critic))

    @torch.no_grad()
    def _load_head(self) -> None:
        """``score.weight`` / ``score.bias`` of an exported critic into the value head (last stage)."""
        from safetensors import safe_open

        index = os.path.join(self.hf_dir, "model.safetensors.index.json")
        files = ["model.safetensors"]
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        found: dict[str, torch.Tensor] = {}
        for name in files:
            with safe_open(os.path.join(self.hf_dir, name), "pt") as f:
                found.update({k: f.get_tensor(k) for k in ("score.weight", "score.bias") if k in f.keys()})
        if "score.weight" not in found:
            raise ValueError(f"--critic-hf-model: {self.hf_dir} is a token-classification model without score.weight")
        for chunk in self.models:
            if chunk.post_process:
                head = cast(ValueHead, chunk.output_layer)
                head.weight.copy_(found["score.weight"].reshape(head.weight.shape))
                head.bias.copy_(found.get("score.bias", torch.zeros(1)).reshape(head.bias.shape))

    def values(self, micro_batches: list[MicroBatch], response_lens: torch.Tensor) -> TokenStore:
        """V(s_t) of every response token of the micro-batches (forward only).

        Args:
            micro_batches: This rank's micro-batches (padded or packed).
            response_lens: ``[S]`` response lengths of the step (the store's layout).

        Returns:
            A :class:`TokenStore` of float32 values, response i's ``[R_i]`` at its offsets (last pipeline stage; zeros
            elsewhere and for responses not in the micro-batches).
        """
        device = next(self.models[0].parameters()).device
        store = TokenStore.zeros(response_lens, device)

        def collect(output: torch.Tensor, mb: MicroBatch):
            scored = mb.scored(token_values(output))
            store.put(scored, scored.logp)
            return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        for m in self.trainable.models:
            m.eval()
        with torch.no_grad():
            run_schedule(self.trainable.models, micro_batches, collect, forward_only=True)
        return store

    def optimizer_step(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> StepResult:
        """One optimizer step of the critic over this rank's micro-batches of a mini-batch (collective).

        Args:
            micro_batches: This rank's share of the mini-batch.
            loss: The value loss of a micro-batch's scored tokens (``TokenLogprobs.logp`` holds the values v, with
                grad), Megatron's ``(loss_sum, count, report)``.
        """
        return optimizer_step(self.trainable, micro_batches, lambda output, mb: loss(mb.scored(token_values(output))))

    def offload_training_state(self) -> None:
        """The critic's optimizer state and gradient buffers to host memory while the engines generate
        (``--colocate --offload-optimizer-during-rollout``; GPU only)."""
        offload_trainable(self.trainable)

    def onload_training_state(self) -> None:
        """Undo :meth:`offload_training_state` before the critic's update."""
        onload_trainable(self.trainable)


def token_values(output: torch.Tensor) -> torch.Tensor:
    """``[b, L - 1]``: the value head's ``[b, L, 1]`` output at positions 0..L-2; entry ``t`` is read for the token at
    position ``t + 1`` (V before that token, the log-probs' offset)."""
    return output[..., 0][:, :-1]


@contextmanager
def _without_heads(models: Sequence[GPTModel]) -> Iterator[None]:
    """The value heads out of the chunks for the trunk's export (the bridge exports every parameter it finds)."""
    heads = [(m, m.output_layer) for m in models if m.post_process]
    for m, _ in heads:
        m.output_layer = torch.nn.Identity()  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        for m, head in heads:
            m.output_layer = head


def export_critic_hf_weights(
    models: Sequence[GPTModel], groups: ParallelGroups, hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The critic as a Hugging Face token-classification model with one label: the trunk under ``model.*`` (the
    causal LM's names; embeddings untied), the value head as ``score.weight`` ``[1, h]`` and ``score.bias`` ``[1]``
    (broadcast from the last pipeline stage). Every rank must iterate to the end (collectives).

    Args:
        models: The critic's chunks (:func:`attach_value_heads`), unwrapped.
        groups: Their parallel groups.
        hf_config: The critic's :func:`untied` config.
    """
    with _without_heads(models):
        yield from export_hf_weights(models, groups, hf_config)
    device = next(models[0].parameters()).device
    dtype = models[0].config.params_dtype
    head = torch.zeros(hf_config.hidden_size + 1, dtype=dtype, device=device)
    for m in models:
        if m.post_process:
            value_head = cast(ValueHead, m.output_layer)
            head.copy_(torch.cat([value_head.weight.detach()[0], value_head.bias.detach()]))
    if groups.pp_size > 1:
        with cuda_to_cpu():
            dist.broadcast(head, src=groups.last_stage_global_rank, group=groups.pp_group)
    yield "score.weight", head[:-1].reshape(1, -1).clone()
    yield "score.bias", head[-1:].clone()


def token_classification_config(hf_config: Any) -> Any:
    """``hf_config`` as a one-label token-classification model's (``<Family>ForTokenClassification``, with the
    ``score`` head's bias), the form transformers loads the exported critic in."""
    out = untied(hf_config)
    arch = (getattr(hf_config, "architectures", None) or ["ForCausalLM"])[0]
    out.architectures = [arch.replace("ForCausalLM", "ForTokenClassification")]
    out.num_labels = 1
    out.token_classification_bias = True
    return out
