"""A step's rollouts as flat tensors (:class:`RolloutBatch`): what a source hands the trainer.

Pure PyTorch. Legend: P prompts, n group size, S = P * n responses (groups contiguous). Who trains which of them, in
which mini- and micro-batches, is the layout's (:mod:`megatron_pacs.data.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch"]


@dataclass
class RolloutBatch:
    """One step's responses in group order, as flat tensors.

    The metadata (lengths, rewards) covers all S responses on every rank; the tokens may cover only some of them
    (a data-parallel rank's share, :meth:`share`): ``offsets`` then gives the others length 0.

    Attributes:
        token_ids: ``[sum L_i]`` long, the held sequences (prompt + response) one after another, in index order.
        offsets: ``[S + 1]`` long: sequence i is ``token_ids[offsets[i]:offsets[i + 1]]`` (empty when not held).
        prompt_lens: ``[S]`` prompt lengths.
        response_lens: ``[S]`` response lengths (>= 1).
        rewards: ``[S]`` float rewards in [0, 1].
        group_size: n.
        engine_logprobs: ``[sum R_i]`` float32, the engines' log-probs of the held responses' sampled tokens
            (temperature 1, response after response; NaN where the engine gave none), or None.
        routed_experts: ``[sum L_i, layers, k]`` int16, aligned with ``token_ids``: the experts the engine routed
            each held token to, for router replay (``--router-replay r3``); -1 where it gave none (a sequence's
            last token, which the engine never ran through the model); None without replay.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    engine_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        prompt_lens: torch.Tensor,
        response_lens: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        engine_logprobs: torch.Tensor | None = None,
        routed_experts: Sequence[torch.Tensor | None] | None = None,
    ) -> RolloutBatch:
        """A batch holding every sequence, from token lists (prompt followed by response), and with
        ``routed_experts`` the engine's routing of each (``[tokens, layers, k]`` from its first token, vLLM's
        ``L_i - 1``; None for a sequence without one: the batch then has none)."""
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
        offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        flat = [t for s in sequences for t in s]
        return cls(
            torch.tensor(flat, dtype=torch.long),
            offsets,
            prompt_lens,
            response_lens,
            rewards,
            group_size,
            engine_logprobs,
            _aligned_routing(routed_experts, lengths.tolist()),
        )

    @property
    def num_responses(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_prompts(self) -> int:
        return self.num_responses // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        """``[S]`` sequence lengths (prompt + response), known on every rank."""
        return self.prompt_lens.long() + self.response_lens.long()

    @property
    def held(self) -> torch.Tensor:
        """``[S]`` bool: the sequences whose tokens this batch holds."""
        return self.offsets[1:] > self.offsets[:-1]

    @property
    def engine_offsets(self) -> torch.Tensor:
        """``[S + 1]``: response i's engine log-probs are ``engine_logprobs[engine_offsets[i]:engine_offsets[i+1]]``."""
        out = torch.zeros(self.num_responses + 1, dtype=torch.long)
        out[1:] = torch.cumsum(torch.where(self.held, self.response_lens.long(), 0), 0)
        return out

    def sequence(self, i: int) -> torch.Tensor:
        """``[L_i]`` token ids of sequence i (it must be held)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if end == start:
            raise ValueError(f"sequence {i} is not held by this batch (another data-parallel rank's share)")
        return self.token_ids[start:end]

    @property
    def sequences(self) -> list[list[int]]:
        """Token lists of every sequence (empty where not held); for dumps and small tools, not the hot path."""
        return [
            self.token_ids[int(a) : int(b)].tolist() for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)
        ]

    def share(self, rows: Sequence[int]) -> RolloutBatch:
        """The same batch holding only ``rows``' tokens (and engine log-probs)."""
        keep = sorted(set(rows))
        tokens = [self.sequence(i) for i in keep]
        lengths = torch.zeros(self.num_responses, dtype=torch.long)
        lengths[keep] = self.lengths[keep]
        offsets = torch.zeros(self.num_responses + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        engine = None
        if self.engine_logprobs is not None:
            eo = self.engine_offsets
            parts = [self.engine_logprobs[int(eo[i]) : int(eo[i + 1])] for i in keep]
            engine = torch.cat(parts) if parts else self.engine_logprobs[:0]
        flat = torch.cat(tokens) if tokens else self.token_ids[:0]
        routed = None
        if self.routed_experts is not None:
            parts = [self.routed_experts[int(self.offsets[i]) : int(self.offsets[i + 1])] for i in keep]
            routed = torch.cat(parts) if parts else self.routed_experts[:0]
        return RolloutBatch(
            flat, offsets, self.prompt_lens, self.response_lens, self.rewards, self.group_size, engine, routed
        )


def _aligned_routing(routing: Sequence[torch.Tensor | None] | None, lengths: list[int]) -> torch.Tensor | None:
    """``[sum L_i, layers, k]`` int16 from each sequence's ``[<= L_i, layers, k]`` (-1 beyond what was given)."""
    if not routing or any(r is None for r in routing):
        return None
    given = [r for r in routing if r is not None]
    _, layers, k = given[0].shape
    out = torch.full((sum(lengths), layers, k), -1, dtype=torch.int16)
    offset = 0
    for r, n in zip(given, lengths, strict=True):
        m = min(n, r.shape[0])
        out[offset : offset + m] = r[:m].to(torch.int16)
        offset += n
    return out
