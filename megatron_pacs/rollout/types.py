"""What the rollout side trades in: sampling settings, response groups, and the two engine protocols.

:class:`RolloutEngine` is what the trainer calls (one engine, or the fleet behind the same calls);
:class:`FleetEngine` is what the fleet calls on each engine of a backend (docs/architecture.md, "The engine
contract"). No vLLM or Ray import here: the trainer, the evaluator and the tests use these types without paying for
either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_pacs.config import RolloutConfig
    from megatron_pacs.rollout.sync import TensorMeta

__all__ = ["FleetEngine", "Prompt", "Response", "RolloutEngine", "RolloutGroup", "SamplingConfig"]

# A prompt is either text (the engine tokenizes it) or token ids (what the trainer sends: no second tokenization).
Prompt = str | Sequence[int]


@dataclass(kw_only=True)
class SamplingConfig:
    """How to sample the n responses of every prompt."""

    n: int = 1
    """Responses per prompt (the PACS group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (then every response of a group is the same)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    max_tokens: int = 256
    """Maximum new tokens per response."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (not included in the response)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop token ids besides the model's end-of-sequence token."""
    seed: int | None = None
    """Base seed: prompt i of a call samples with ``seed + i`` so results do not depend on how prompts are spread
    across engines. None leaves sampling unseeded."""
    logprobs: bool = True
    """Return the log-prob of every sampled token (under the engine's weights, after temperature)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence until ``max_tokens`` (benchmarks)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n={self.n}: sample at least one response per prompt")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: use 0 (greedy) or a positive value")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: must lie in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k={self.top_k}: use -1 (off) or a positive count")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens={self.max_tokens}: generate at least one token")


@dataclass
class Response:
    """One sampled response.

    Attributes:
        token_ids: The generated token ids (stop strings excluded, an end-of-sequence token included).
        text: The decoded response, special tokens skipped.
        logprobs: One float per entry of ``token_ids`` (empty when not requested).
        finish_reason: ``"stop"`` (end of sequence or a stop string), ``"length"`` (hit ``max_tokens``) or
            ``"abort"``.
        routed_experts: ``[P + R - 1, layers, k]`` int16, the experts the engine routed each token of the prompt
            and the response to (all but the last token, which it never ran through the model), when asked for
            (``--router-replay r3``); None otherwise.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }


@dataclass
class RolloutGroup:
    """The n responses of one prompt.

    Attributes:
        prompt: The prompt as given (text or token ids).
        prompt_token_ids: The prompt's token ids as the engine saw them.
        responses: ``n`` responses, in sample order.
    """

    prompt: Prompt
    prompt_token_ids: list[int]
    responses: list[Response]

    def to_dict(self) -> dict[str, Any]:
        prompt = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        return {
            "prompt": prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "responses": [r.to_dict() for r in self.responses],
        }


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls: one engine of a backend, or a fleet of them behind the same five calls."""

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for every prompt; one group per prompt, in the prompts' order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load new weights given under their Hugging Face names; later generations use them.

        Returns:
            Sync statistics for the metrics log: ``sync/seconds``, ``sync/megabytes`` (packed bytes sent) and
            ``sync/num_buckets``.
        """
        ...

    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory while the trainer uses the same devices: level 1 keeps a host copy of the
        weights and drops the KV cache; level 2 drops both (the next weight update refills them)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` for ``tags`` (``"weights"``, ``"kv_cache"``; None: everything)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and release every process and file it created."""
        ...


@runtime_checkable
class FleetEngine(Protocol):
    """What the fleet calls on one engine of a backend, inside its Ray actor, by these methods' names.

    A backend class (registered in :mod:`megatron_pacs.rollout.backends`) implements this and
    :class:`RolloutEngine`, and is built as ``cls(model, **cls.engine_kwargs(config, ...))`` with ``model`` a Hugging
    Face model directory. A weight update is ``begin_weight_update``, then every bucket through one transport
    (``load_bucket``, ``receive_broadcast`` or ``load_ipc``), then ``finish_weight_update``; a packed bucket is one
    flat ``uint8`` buffer of ``B`` bytes and a :class:`~megatron_pacs.rollout.sync.TensorMeta` per tensor in it.
    """

    @classmethod
    def engine_kwargs(
        cls, config: RolloutConfig, *, dtype: str, max_model_len: int | None, seed: int, on_gpu: bool
    ) -> dict[str, Any]:
        """The constructor's keywords from the generic rollout settings (called in the driver, before the actor).

        Args:
            config: The fleet's settings (``--rollout-*``, memory, KV cache, ``--colocate``).
            dtype: The engines' dtype (``"auto"``, ``"float32"``, ``"bfloat16"``...).
            max_model_len: Longest prompt + response (None: the model's).
            seed: Engine seed.
            on_gpu: Whether the engines run on GPUs (else CPU).

        Returns:
            Keyword arguments for ``cls(model, **kwargs)``; they cross Ray, so plain values only.
        """
        ...

    @classmethod
    def actor_env(cls, *, on_gpu: bool) -> dict[str, str]:
        """Environment variables of the engine's Ray actor (read in the driver: its own settings pass through)."""
        ...

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingConfig, prompt_indices: Sequence[int] | None = None
    ) -> list[RolloutGroup]:
        """Sample one chunk of the fleet's prompts.

        Args:
            prompts: The chunk's prompts (text or token ids).
            sampling: Sampling settings; with a seed, prompt ``i`` of the caller's full list samples with
                ``seed + i * n``, so results do not depend on which engine ran it.
            prompt_indices: The chunk's positions in the caller's full list (default ``0..len-1``).

        Returns:
            One group per prompt, in order.
        """
        ...

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs (the sync probe).

        Args:
            token_ids: Full sequences (prompt + response), row ``i`` of length ``L_i``.

        Returns:
            Per row, ``L_i - 1`` floats: entry ``t`` is ``log p(ids[t + 1] | ids[:t + 1])``.
        """
        ...

    def begin_weight_update(self) -> None:
        """Start an update: the buckets that follow may cut layers anywhere."""
        ...

    def load_bucket(self, buffer: torch.Tensor, metas: list[TensorMeta]) -> None:
        """Load one packed bucket that came through Ray's object store.

        Args:
            buffer: ``[B]`` uint8 on the host, the tensors packed at ``metas``' offsets.
            metas: Name, shape, dtype, offset and size of every tensor in ``buffer``.
        """
        ...

    def init_broadcast_group(self, backend: str, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the broadcast side group of trainer rank 0 (rank 0) and every engine worker.

        Args:
            backend: ``"nccl"`` (GPU) or ``"gloo"`` (CPU).
            host: Trainer rank 0's address for the rendezvous.
            port: Its port.
            rank_offset: This engine's first rank; its tensor-parallel worker ``r`` joins as ``rank_offset + r``.
            world_size: 1 + every engine's tensor-parallel size.
        """
        ...

    def receive_broadcast(self, metas: list[TensorMeta], nbytes: int) -> None:
        """Receive one packed bucket broadcast from rank 0 of the side group, then load it.

        Args:
            metas: The bucket's tensors.
            nbytes: ``B``, the size of the ``[B]`` uint8 buffer to receive into (on the engine's device).
        """
        ...

    def load_ipc(self, handle: list[Any], metas: list[TensorMeta]) -> None:
        """GPU only: map trainer rank 0's packed ``[B]`` uint8 CUDA buffer and load it (colocated engines).

        Args:
            handle: A :func:`~megatron_pacs.rollout.sync.ipc_handle` of the buffer (plain values).
            metas: The bucket's tensors.
        """
        ...

    def finish_weight_update(self) -> int:
        """Process the loaded layers and drop every cached prefix (its KV came from the old weights).

        Returns:
            The number of tensors loaded.
        """
        ...

    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory (see :meth:`RolloutEngine.sleep`); a no-op where there is none."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` for ``tags`` (``"weights"``, ``"kv_cache"``; None: everything)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and release every process and file it created."""
        ...
