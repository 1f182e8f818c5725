"""Training objectives as objects: what log-probs each needs, and its micro-batch loss from token log-probs.

An :class:`Objective` states its needs (the rollout policy's log-probs at sequence or token level, or none; the
current policy's sequence log-probs before the backward, i.e. phase 1 of the two-phase gradient; whole groups per
micro-batch) and turns one optimizer step's share of responses (:class:`MiniBatch`) into a :class:`Prepared` loss:
a function from a micro-batch's scored tokens (:class:`~megatron_pacs.algo.tokens.TokenLogprobs`, flat, the same
for padded and packed layouts) to Megatron's ``(loss_sum, count, report)``. The step that drives them
(``megatron_pacs.update``) knows nothing of PACS or GRPO. Every objective's ``count`` is the number of responses in
the micro-batch, so the trainer divides once by the global response count (docs/algorithm.md §4). Sequence sums and
scores are float64 (docs/algorithm.md §2.1).

Registered names (``--loss``, :data:`~megatron_pacs.config.objectives.OBJECTIVES`): ``pacs`` (two-phase by default,
direct with ``--keep-groups-in-microbatch``), the token-level ``grpo``, ``gspo`` and ``cispo``
(:mod:`megatron_pacs.algo.token_objectives`) and ``ppo`` (:mod:`megatron_pacs.algo.ppo`). Whenever a reference
policy exists (``--kl-coef > 0`` or ``--pacs-score-reference ref``), :class:`KLRegularized` wraps the objective: it
adds the KL term (if any) and reports ``ref/kl``. A new objective (a REAL- or NFT-style sequence loss) is one new
class here (declare its needs, write ``prepare``) with a builder, and its
:class:`~megatron_pacs.config.objectives.ObjectiveSpec` registered in ``config/objectives.py`` (its default TIS
level, its reference need, its FP8 score policy, its own flags).

Legend: S responses of the step, M responses of the mini-batch on this rank, m responses and N scored tokens of a
micro-batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from megatron_pacs.algo.kl import kl_estimate
from megatron_pacs.algo.metrics import pacs_metrics
from megatron_pacs.algo.pacs import (
    compute_scores,
    degenerate_std_metrics,
    group_advantages,
    group_weights,
    pacs_loss,
    pacs_score_grads,
    pacs_surrogate,
)
from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
from megatron_pacs.config import BatchConfig, LossConfig
from megatron_pacs.config.objectives import OBJECTIVES

__all__ = [
    "OBJECTIVES",
    "KLRegularized",
    "Logprobs",
    "MicroBatchLoss",
    "MiniBatch",
    "Objective",
    "PacsDirect",
    "PacsTwoPhase",
    "Prepared",
    "StepTensors",
    "TokenLogprobs",
    "build_objective",
    "build_pacs",
    "count_of",
]

#: ``(scored tokens of a micro-batch) -> (loss_sum, count, report)``, Megatron's 3-tuple.
MicroBatchLoss = Callable[[TokenLogprobs], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
Level = Literal["sequence", "token"]


@dataclass
class Logprobs:
    """Log-probs of a step's responses under one policy, indexed by response.

    Attributes:
        seq: ``[S]`` float64 sums over each response's tokens (0 for responses that were not computed).
        tokens: Each response's token log-probs, when asked for (last pipeline stage only).
    """

    seq: torch.Tensor
    tokens: TokenStore | None = None


@dataclass
class MiniBatch:
    """What an objective sees of one optimizer step: this rank's responses and the step's tensors.

    Attributes:
        rows: ``[M]`` response indices of this rank's share (whole groups, contiguous).
        rewards: ``[S]`` the step's rewards in [0, 1].
        response_lens: ``[S]`` response lengths in tokens.
        group_size: n.
        fresh: No optimizer step has happened since the rollout (the first mini-batch of the first epoch), so the
            current policy is the rollout policy exactly.
        old: The rollout policy's log-probs (None when ``fresh`` or when the objective needs none).
        current: ``[S]`` float64 phase-1 sequence log-probs under the current parameters, when requested.
        ref: The reference policy's log-probs, when the objective needs them.
        importance: Truncated importance ratios pi_anchor / pi_behaviour of the rollouts (``seq`` ``[S]`` or
            ``tokens``, at the objective's ``correction`` level), when ``--off-policy-correction tis``.
        at_reference: ``fresh`` and the current parameters are the reference's exactly (step 1 from the reference's
            weights, or the first mini-batch after a reset): a reference-anchored score and the KL are then 0
            exactly, whatever rounding separate passes would give (docs/algorithm.md §2.2).
        batch_rows: ``[M]`` every data-parallel rank's responses of this mini-batch (what a token- or
            sequence-mean aggregation divides by); None: ``rows`` (one rank).
        advantages: Per-token advantages of the step's responses from a learned critic (PPO's GAE, computed before
            the update; last pipeline stage), when the objective takes them.
    """

    rows: torch.Tensor
    rewards: torch.Tensor
    response_lens: torch.Tensor
    group_size: int
    fresh: bool
    old: Logprobs | None = None
    current: torch.Tensor | None = None
    ref: Logprobs | None = None
    importance: Logprobs | None = None
    at_reference: bool = False
    batch_rows: torch.Tensor | None = None
    advantages: TokenStore | None = None


@dataclass
class Prepared:
    """An objective ready for one optimizer step: the micro-batch loss and metrics computed up front.

    Attributes:
        loss: The micro-batch loss.
        metrics: Metrics of the step computed in ``prepare``.
        token_scale: ``(scored tokens) -> [N]`` each token's weight in the objective's aggregation, for a per-token
            term added to its loss (the KL): the term is ``sum_t scale_t * k_t / token_norm`` with the objective's
            count. None: weight 1 and ``token_norm`` T_max (GRPO's and the KL's default aggregation).
        token_norm: The constant divided out after ``token_scale``'s sum.
    """

    loss: MicroBatchLoss
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    token_scale: Callable[[TokenLogprobs], torch.Tensor] | None = None
    token_norm: float = 1.0


class Objective(ABC):
    """A training objective (see the module docstring)."""

    #: The metric reported as ``train/loss``.
    loss_key: str = "train/loss"
    #: The rollout policy's log-probs the loss compares against, recomputed when the parameters may have moved.
    old_logprobs: Level | None = None
    #: The reference policy's log-probs the loss needs (computed once per step over every response).
    ref_logprobs: Level | None = None
    #: Micro-batches must hold whole groups.
    whole_groups: bool = False
    #: The level of the off-policy importance weights it takes (``--off-policy-correction tis``): ``token``,
    #: ``geometric`` or ``sequence`` (``--tis-level``), or None.
    correction: str | None = None
    #: The loss differentiates the tokens' entropies (``TokenLogprobs.entropy``: an entropy bonus).
    entropy_grad: bool = False

    @property
    def loss_keys(self) -> tuple[str, ...]:
        """The metrics whose sum is ``train/loss`` (the objective's own loss plus any added term)."""
        return (self.loss_key,)

    def needs_current(self, fresh: bool, at_reference: bool = False) -> bool:
        """Whether ``prepare`` needs the current policy's sequence log-probs (a forward pass before the backward);
        ``fresh`` and ``at_reference`` as in :class:`MiniBatch`."""
        del fresh, at_reference
        return False

    @abstractmethod
    def prepare(self, mb: MiniBatch) -> Prepared:
        """The loss of one optimizer step over ``mb``'s responses (its micro-batches may be cut any way unless
        ``whole_groups``)."""


def count_of(tokens: TokenLogprobs) -> torch.Tensor:
    """A micro-batch loss's ``count``: its responses, as Megatron's int tensor."""
    return torch.tensor(tokens.num_sequences, dtype=torch.int)


class StepTensors:
    """A step's ``[S]`` tensors, copied to the device of the micro-batch losses once.

    Micro-batch losses index them with the micro-batch's device-side response indices; copying per micro-batch (or
    bringing the indices to the host) would be a host sync per micro-batch.
    """

    def __init__(self, **tensors: torch.Tensor | None) -> None:
        self._host = {k: v for k, v in tensors.items() if v is not None}
        self._device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._device:
            self._device[device] = {k: v.to(device) for k, v in self._host.items()}
        return self._device[device]


class _Pacs(Objective):
    """PACS (docs/algorithm.md §2): s = beta * (l - l_anchor) or beta * l / L, group logits, weighted BCE on R.

    The anchor is the rollout policy (``--pacs-score-reference old``, the released code) or the frozen reference
    (``ref``, PACS v2, §2.2), whose log-probs come once per step for every response.
    """

    loss_key = "pacs/loss"

    def __init__(self, cfg: LossConfig) -> None:
        self.beta, self.score = cfg.pacs_beta, cfg.pacs_score
        self.advantage, self.weights = cfg.pacs_advantage, cfg.pacs_weights
        log_ratio = cfg.pacs_score == "log_ratio"
        self.ref_anchor = log_ratio and cfg.pacs_score_reference == "ref"
        self.old_logprobs = "sequence" if log_ratio and not self.ref_anchor else None
        self.ref_logprobs = "sequence" if self.ref_anchor else None
        self.correction = cfg.tis_ratio_level

    @staticmethod
    def _sample_weights(mb: MiniBatch, idx: torch.Tensor) -> torch.Tensor | None:
        return None if mb.importance is None else mb.importance.seq[idx].cpu()

    def _anchor(self, mb: MiniBatch) -> torch.Tensor | None:
        """``[S]`` l_anchor: the reference's, or the rollout policy's (None when ``fresh``: l_old = l exactly)."""
        if self.ref_anchor:
            assert mb.ref is not None, "the step computes the reference's log-probs for a ref-anchored objective"
            return mb.ref.seq
        return None if mb.old is None else mb.old.seq

    def _scores(self, seq: torch.Tensor, t: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """``compute_scores`` on a micro-batch, without its input checks (done on the step's tensors in ``prepare``,
        where they cost no device sync)."""
        if self.score == "log_ratio":
            return self.beta * (seq - t["anchor"][idx])
        return self.beta * seq / t["lens"][idx].to(seq.dtype)


class PacsTwoPhase(_Pacs):
    """PACS through the two-phase group gradient (docs/algorithm.md §3): micro-batches may split groups.

    Phase 1 computes every response's score under the current parameters (free, and exactly 0, when ``fresh``
    with ``log_ratio``), then ``c = dL/ds`` in closed form per group; the micro-batch loss is the surrogate
    ``sum_i c_i * s_i(theta)``, whose gradient is the exact PACS gradient. The reported ``pacs/loss`` is the
    phase-1 loss.
    """

    def needs_current(self, fresh: bool, at_reference: bool = False) -> bool:
        # Free (s = 0 exactly) when the parameters equal the anchor: pi_old with no update yet, or the reference.
        return not (fresh and self.score == "log_ratio" and (at_reference or not self.ref_anchor))

    def prepare(self, mb: MiniBatch) -> Prepared:
        idx, num = mb.rows, mb.rewards.shape[0]
        log_ratio = self.score == "log_ratio"
        anchor = self._anchor(mb)
        if mb.current is None:  # theta == theta_anchor exactly (needs_current): s = 0
            scores = torch.zeros(len(idx), dtype=torch.float64)
        else:
            old = anchor[idx].cpu() if log_ratio and anchor is not None else None
            scores = compute_scores(
                mb.current[idx].cpu(), old, beta=self.beta, score=self.score, response_lens=mb.response_lens[idx]
            )
        grads = pacs_score_grads(
            scores,
            mb.rewards[idx],
            group_size=mb.group_size,
            advantage=self.advantage,
            weights=self.weights,
            normalizer=1.0,
            sample_weights=self._sample_weights(mb, idx),
        )
        coeffs = torch.zeros(num, dtype=grads.dtype)
        coeffs[idx] = grads
        if anchor is None and log_ratio:
            # fresh: l_old = l; only the surrogate's gradient matters, not its value
            anchor = torch.zeros(num, dtype=torch.float64)
        return Prepared(self._loss(anchor, coeffs, mb.response_lens), self._phase1_metrics(scores, mb, idx))

    def _loss(self, anchor: torch.Tensor | None, coeffs: torch.Tensor, lens: torch.Tensor) -> MicroBatchLoss:
        step = StepTensors(anchor=anchor, coeffs=coeffs, lens=lens)

        def loss(tokens: TokenLogprobs):
            seq = tokens.sequence_sums()
            t = step.on(seq.device)
            surrogate = pacs_surrogate(self._scores(seq, t, tokens.index), t["coeffs"][tokens.index])
            return surrogate.float(), count_of(tokens), {}

        return loss

    def _phase1_metrics(self, scores: torch.Tensor, mb: MiniBatch, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The PACS loss and critic metrics at the phase-1 scores (the loss value the step minimises)."""
        n, rewards = mb.group_size, mb.rewards[idx]
        adv = group_advantages(scores, group_size=n, advantage=self.advantage)
        w = group_weights(rewards, group_size=n, weights=self.weights)
        sample_weights = self._sample_weights(mb, idx)
        loss_w = w if sample_weights is None else w * sample_weights.to(w)
        loss_sum = F.binary_cross_entropy_with_logits(adv, rewards, weight=loss_w, reduction="sum")
        m = pacs_metrics(scores, adv, rewards, w, group_size=n, sample_weights=sample_weights)
        m.update(degenerate_std_metrics(scores, group_size=n, advantage=self.advantage))
        m["pacs/loss"] = torch.stack([loss_sum, loss_sum.new_tensor(float(scores.numel()))])
        return m


class PacsDirect(_Pacs):
    """PACS with whole groups per micro-batch and autograd through the group (the reference's layout)."""

    whole_groups = True

    def prepare(self, mb: MiniBatch) -> Prepared:
        anchor = self._anchor(mb)
        importance = None if mb.importance is None else mb.importance.seq
        step = StepTensors(anchor=anchor, rewards=mb.rewards, lens=mb.response_lens, importance=importance)

        def loss(tokens: TokenLogprobs):
            seq = tokens.sequence_sums()
            t, idx = step.on(seq.device), tokens.index
            # No old log-probs means the parameters have not moved since the rollout: l_old = l, exactly; likewise
            # l_ref = l exactly while the parameters are the reference's.
            old = seq.detach() if anchor is None or mb.at_reference else t["anchor"][idx]
            out = pacs_loss(
                seq,
                old,
                t["rewards"][idx],
                group_size=mb.group_size,
                beta=self.beta,
                score=self.score,
                advantage=self.advantage,
                weights=self.weights,
                response_lens=t["lens"][idx],
                sample_weights=t["importance"][idx] if importance is not None else None,
            )
            return out.loss_sum.float(), count_of(tokens), out.metrics

        return Prepared(loss)


class KLRegularized(Objective):
    """An objective plus ``kl_coef`` x the per-token KL to the reference policy (docs/algorithm.md §2.7).

    The term is ``kl_coef * sum_t k_t / T_max`` per response with the inner objective's count (responses), so it
    obeys the same global normalisation; a token-level objective's ``--loss-agg-mode`` aggregates it as its own
    loss (verl's ``kl_loss_coef * agg_loss(kld, loss_agg_mode)``; :attr:`Prepared.token_scale`). ``ref/kl`` (the
    per-token estimate's mean) is reported even at ``kl_coef = 0``; ``ref/kl_loss`` is the term's value, part of
    ``train/loss``.
    """

    ref_logprobs = "token"

    def __init__(self, inner: Objective, coef: float, estimator: str, max_response_length: int) -> None:
        self.inner, self.coef, self.estimator, self.max_response_length = inner, coef, estimator, max_response_length
        self.loss_key, self.old_logprobs, self.whole_groups = inner.loss_key, inner.old_logprobs, inner.whole_groups
        self.correction, self.entropy_grad = inner.correction, inner.entropy_grad

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return (*self.inner.loss_keys, "ref/kl_loss") if self.coef > 0 else self.inner.loss_keys

    def needs_current(self, fresh: bool, at_reference: bool = False) -> bool:
        return self.inner.needs_current(fresh, at_reference)

    def prepare(self, mb: MiniBatch) -> Prepared:
        prepared = self.inner.prepare(mb)
        assert mb.ref is not None and mb.ref.tokens is not None, "the step computes the reference's token log-probs"
        ref_tokens = mb.ref.tokens

        def loss(tokens: TokenLogprobs):
            loss_sum, count, report = prepared.loss(tokens)
            # at the reference exactly the KL and its gradient are 0, not the rounding of two differently cut passes
            ref_logp = tokens.logp.detach() if mb.at_reference else ref_tokens.gather(tokens)
            value, surrogate = kl_estimate(tokens.logp, ref_logp, self.estimator)
            report = {**report, "ref/kl": torch.stack([value.sum(), value.new_tensor(float(value.numel()))])}
            if self.coef > 0:
                if prepared.token_scale is None:
                    term = self.coef * surrogate.sum() / self.max_response_length
                else:  # the objective's own aggregation (--loss-agg-mode)
                    term = self.coef * (surrogate * prepared.token_scale(tokens)).sum() / prepared.token_norm
                report["ref/kl_loss"] = torch.stack([term.detach(), term.new_tensor(float(tokens.num_sequences))])
                loss_sum = loss_sum + term
            return loss_sum, count, report

        return Prepared(loss, prepared.metrics, prepared.token_scale, prepared.token_norm)


def build_pacs(loss: LossConfig, batch: BatchConfig) -> Objective:
    """PACS (``--loss pacs``): direct with ``--keep-groups-in-microbatch``, else two-phase."""
    return PacsDirect(loss) if batch.keep_groups_in_microbatch else PacsTwoPhase(loss)


def build_objective(loss: LossConfig, batch: BatchConfig) -> Objective:
    """The objective named by ``--loss``, built by the builder its :class:`~megatron_pacs.config.objectives.
    ObjectiveSpec` names; wrapped in :class:`KLRegularized` when a reference exists."""
    objective = OBJECTIVES.get(loss.loss).build(loss, batch)
    if loss.needs_reference:
        objective = KLRegularized(objective, loss.kl_coef, loss.kl_estimator, batch.max_response_length)
    return objective


def __getattr__(name: str):
    # The token-level objectives live in their own module, which imports this one; their old names resolve lazily.
    if name in ("GrpoObjective", "build_grpo"):
        from megatron_pacs.algo import token_objectives

        return getattr(token_objectives, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
