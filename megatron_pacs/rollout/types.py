"""What the rollout side trades in: sampling settings, response groups, and the engine protocol.

No vLLM or Ray import here: the trainer, the evaluator and the tests use these types without paying for either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Prompt", "Response", "RolloutEngine", "RolloutGroup", "SamplingConfig"]

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
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str

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
    """A generation backend: one vLLM engine, or a fleet of them behind the same five calls."""

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
