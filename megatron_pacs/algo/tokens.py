"""Scored tokens, flat: what an objective's micro-batch loss receives, whatever the micro-batch's layout.

A micro-batch (padded rows or one packed row, ``megatron_pacs.mcore.forward.MicroBatch``) holds m responses. Its
scored tokens (the responses' own tokens) are flattened sequence after sequence into ``[N]`` vectors, so every
objective is written once for padded and packed layouts alike (docs/algorithm.md §4.4). Per-response sums are
accumulated in float64 (docs/algorithm.md §2.1): a 4,096-token response's log-likelihood is a sum of thousands of
fp32 terms, and a PACS score is a difference of two such sums.

Legend: N scored tokens of a micro-batch, m responses of a micro-batch, S responses of the step, R_i response i's
length in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenLogprobs", "TokenStore"]


@dataclass
class TokenLogprobs:
    """A micro-batch's scored tokens.

    Attributes:
        logp: ``[N]`` log-probs (float32; differentiable in training), sequence after sequence, in token order.
        seq: ``[N]`` which of the micro-batch's sequences each token belongs to (0..m-1, non-decreasing).
        rank: ``[N]`` the token's position within its response (0..R_i-1).
        index: ``[m]`` the response index (in the step) of each sequence.
        lengths: ``[m]`` scored tokens per sequence (``R_i``), on ``logp``'s device.
        raw: ``[N]`` the same tokens' log-probs at temperature 1 (detached), when asked for: what the rollout
            engines report, for the train/rollout consistency check.
    """

    logp: torch.Tensor
    seq: torch.Tensor
    rank: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor
    raw: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.index.numel())

    def sequence_sums(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """``[m]`` float64 per-sequence sums of ``values`` (default: ``logp``), differentiable, deterministic."""
        v = self.logp if values is None else values
        return torch.segment_reduce(v.double(), "sum", lengths=self.lengths, unsafe=True)


@dataclass
class TokenStore:
    """Per-token values of a step's responses (old or reference log-probs), flat: response i's tokens are
    ``values[offsets[i]:offsets[i + 1]]``.

    Attributes:
        values: ``[sum R_i]`` float32.
        offsets: ``[S + 1]`` long, on ``values``' device.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def zeros(cls, response_lens: torch.Tensor, device: torch.device | str) -> TokenStore:
        """An all-zero store for responses of ``response_lens`` ``[S]`` tokens."""
        lens = response_lens.to(torch.long)
        offsets = torch.zeros(lens.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lens, 0)
        return cls(torch.zeros(int(offsets[-1]), dtype=torch.float32, device=device), offsets.to(device))

    def _positions(self, tokens: TokenLogprobs) -> torch.Tensor:
        device = self.values.device
        return self.offsets[tokens.index.to(device)][tokens.seq.to(device)] + tokens.rank.to(device)

    def gather(self, tokens: TokenLogprobs) -> torch.Tensor:
        """``[N]``: the stored value of each of ``tokens``' scored tokens."""
        return self.values[self._positions(tokens)].to(tokens.logp.device)

    def put(self, tokens: TokenLogprobs, values: torch.Tensor) -> None:
        """Store ``values`` ``[N]`` at ``tokens``' positions."""
        self.values[self._positions(tokens)] = values.detach().to(self.values)

    def response(self, i: int) -> torch.Tensor:
        """``[R_i]``: response i's values."""
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]
