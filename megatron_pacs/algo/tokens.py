"""A micro-batch and its scored tokens: the model's input layout, and the flat view every objective receives.

A micro-batch (:class:`MicroBatch`) comes in one of two layouts (docs/algorithm.md §4.4):

- **padded**: ``tokens [b, L]``, one right-padded sequence per row; extra rows that only give pipeline messages
  one shape copy row 0 and are never scored (``index`` -1);
- **packed**: ``tokens [1, T]``, the sequences one after another, then padding; ``seqlens`` gives their lengths,
  and the model runs them in Megatron's ``thd`` format (RoPE restarts, attention confined to each sequence).

``score_mask`` marks the positions whose token is scored (the response). The log-prob of token t comes from the
logits at position t - 1, so position 0 is never scored, nor a sequence's first token in a packed row. Whatever
the layout, :meth:`MicroBatch.scored` flattens the scored tokens (the responses' own tokens) sequence after
sequence into ``[N]`` vectors (:class:`TokenLogprobs`), from positions computed once on the host (no device sync),
so every objective is written once for padded and packed layouts alike. Per-response sums are accumulated in
float64 (docs/algorithm.md §2.1): a 4,096-token response's log-likelihood is a sum of thousands of fp32 terms, and
a PACS score is a difference of two such sums.

Legend: N scored tokens of a micro-batch, m responses of a micro-batch, S responses of the step, R_i response i's
length in tokens, b rows, L padded length, T packed length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MicroBatch", "TokenLogprobs", "TokenStore", "make_micro_batches", "masked_sequence_sum"]


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
        entropy: ``[N]`` the entropy of each scored position's distribution (from the same log-prob pass; with
            grad when an objective has an entropy bonus), in training passes.
    """

    logp: torch.Tensor
    seq: torch.Tensor
    rank: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor
    raw: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

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


@dataclass(eq=False)
class MicroBatch:
    """One micro-batch, padded or packed (see the module docstring).

    Attributes:
        tokens: ``[b, L]`` token ids (b = 1 when packed).
        score_mask: ``[b, L]`` True where the token is scored.
        index: Padded: ``[b]`` response index of each row, -1 for padding rows. Packed: ``[m]`` response index of
            each sequence, in row order.
        seqlens: Packed only: the m sequences' lengths in row order (the rest of the row is padding).
        routed_experts: ``[b, L, layers, k]`` the rollout engine's experts of every token, for router replay
            (``--router-replay r3``; -1 where none was given), or None: the routers choose.
    """

    tokens: torch.Tensor
    score_mask: torch.Tensor
    index: torch.Tensor
    seqlens: tuple[int, ...] | None = None
    routed_experts: torch.Tensor | None = None
    _layout: dict[str, torch.Tensor] = field(init=False, repr=False)
    _on_device: dict[torch.device, dict[str, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tokens.shape != self.score_mask.shape or self.tokens.dim() != 2:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and score_mask {tuple(self.score_mask.shape)} must be one [b, L]"
            )
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 4 or routed.shape[:2] != self.tokens.shape):
            raise ValueError(f"routed_experts {tuple(routed.shape)} must be [b, L, layers, k] with tokens' [b, L]")
        if self.seqlens is not None and (self.tokens.shape[0] != 1 or len(self.seqlens) != self.index.numel()):
            raise ValueError("a packed micro-batch is one row with one length per index entry")
        self._layout = self._scored_layout()
        self._on_device = {}

    @property
    def packed(self) -> bool:
        return self.seqlens is not None

    @property
    def num_padding(self) -> int:
        """Token positions that belong to no sequence (pipeline rows, row tails, the packed tail)."""
        return self.tokens.numel() - int(self._layout["seq_tokens"].sum())

    @property
    def sequence_index(self) -> torch.Tensor:
        """``[m]`` response index of each real sequence, in layout order (host)."""
        return self._layout["index"]

    def position_ids(self) -> torch.Tensor:
        """``[b, L]`` positions within each sequence (host)."""
        b, length = self.tokens.shape
        if self.seqlens is None:
            return torch.arange(length)[None].expand(b, length)
        pos = torch.arange(length)
        starts = torch.zeros(length, dtype=torch.long)
        offset = 0
        for n in self.seqlens:
            starts[offset : offset + n] = offset
            offset += n
        starts[offset:] = offset
        return (pos - starts)[None]

    def _scored_layout(self) -> dict[str, torch.Tensor]:
        """Where each scored token's log-prob sits in the ``[b, L - 1]`` log-prob tensor, and whose it is."""
        mask = self.score_mask[:, 1:].cpu().bool()
        length = mask.shape[1]
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: sequence after sequence, tokens in order
        index = self.index.cpu().long()
        if self.seqlens is None:
            real = index >= 0
            if bool(mask[~real].any()):
                raise ValueError("padding rows (index -1) must have an empty score mask")
            seq_of_row = torch.cumsum(real.long(), 0) - 1
            seq = seq_of_row[rows]
            seq_index = index[real]
            # a padded row's sequence ends with its response: its length is the last scored position + 1
            cols_all = torch.arange(length)[None].expand_as(mask)
            last = torch.where(mask, cols_all, -1).amax(1) + 2
            seq_tokens = torch.where(last > 1, last, length + 1)[real]
        else:
            bounds = torch.tensor([0, *torch.tensor(self.seqlens).cumsum(0).tolist()], dtype=torch.long)
            # token at position c + 1 belongs to the sequence whose [start, end) holds it
            seq = torch.searchsorted(bounds, cols + 1, right=True) - 1
            seq_index = index
            seq_tokens = torch.tensor(self.seqlens, dtype=torch.long)
        m = int(seq_index.numel())
        lengths = torch.bincount(seq, minlength=m) if seq.numel() else torch.zeros(m, dtype=torch.long)
        firsts = torch.cumsum(lengths, 0) - lengths
        rank = torch.arange(seq.numel()) - firsts[seq]
        return {
            "flat_pos": rows * length + cols,
            "seq": seq,
            "rank": rank,
            "index": seq_index,
            "lengths": lengths,
            "seq_tokens": seq_tokens,
        }

    def _layout_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        cached = self._on_device.get(device)
        if cached is None:
            cached = {k: v.to(device, non_blocking=True) for k, v in self._layout.items()}
            self._on_device[device] = cached
        return cached

    def scored(self, logp: torch.Tensor, entropy: torch.Tensor | None = None) -> TokenLogprobs:
        """This micro-batch's scored tokens from its ``[b, L - 1]`` token log-probs (and entropies; gradients flow
        back)."""
        lay = self._layout_on(logp.device)
        flat = logp.reshape(-1).index_select(0, lay["flat_pos"])
        ent = None if entropy is None else entropy.reshape(-1).index_select(0, lay["flat_pos"])
        return TokenLogprobs(
            logp=flat, seq=lay["seq"], rank=lay["rank"], index=lay["index"], lengths=lay["lengths"], entropy=ent
        )


def make_micro_batches(tokens: torch.Tensor, score_mask: torch.Tensor, micro_batch_size: int) -> list[MicroBatch]:
    """Split ``[N, L]`` into padded micro-batches of exactly ``micro_batch_size`` rows (the last padded with a copy
    of row 0 whose index is -1, so every pipeline message has one shape)."""
    if tokens.shape != score_mask.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and score_mask {tuple(score_mask.shape)} must be [N, L]")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    n = tokens.shape[0]
    out = []
    for s in range(0, n, micro_batch_size):
        idx = torch.arange(s, min(s + micro_batch_size, n))
        pad = micro_batch_size - idx.numel()
        rows = torch.cat([idx, idx.new_zeros(pad)])
        index = torch.cat([idx, idx.new_full((pad,), -1)])
        keep = (index >= 0)[:, None].to(score_mask.device)
        out.append(
            MicroBatch(tokens[rows.to(tokens.device)], score_mask[rows.to(score_mask.device)].bool() & keep, index)
        )
    return out


def masked_sequence_sum(token_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum token log-probs over each response's real tokens.

    Padding never contributes, whatever value it holds (the reference sums unmasked; docs/algorithm.md §9.2).

    Args:
        token_logp: ``[S, T]`` per-token log-probs.
        mask: ``[S, T]`` bool or 0/1 mask of response tokens.

    Returns:
        ``[S]`` per-response sums, accumulated in float64 (a PACS score is a difference of two such sums:
        docs/algorithm.md §2.1).
    """
    if token_logp.shape != mask.shape:
        raise ValueError(f"token_logp {tuple(token_logp.shape)} and mask {tuple(mask.shape)} must have one shape")
    # where() rather than a product so that -inf/NaN at padded positions cannot leak into the sum.
    return torch.where(mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(dim=-1, dtype=torch.float64)
