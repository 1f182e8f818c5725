"""Asynchronous rollouts (``--max-staleness K``): the groups the engines work on across steps, generated in rounds.

A group (one prompt's n responses) is *admitted* under the engines' current weights (version v: the number of updates
behind them) and must be trained by step ``v + K + 1``, its *deadline*, so that no token is more than K updates old
when trained. Admission is paced to keep every group within that budget: at version v at most ``(v + K + 1) * B``
groups (B = ``--global-batch-size``) are admitted since the run's start, less those dropped or filtered. A step takes
B finished groups, the earliest deadline first; a group due at that step and not finished is waited for, or dropped
(``--staleness-policy``).

Generation runs in *rounds*: every response still open grows by at most ``--rollout-round-tokens`` tokens
(``--max-response-length`` without ``--partial-rollouts``: then a round finishes every response), re-submitted to
the engines as its prompt and the tokens so far. New prompts are admitted and weight updates land only between
rounds, so with ``--partial-rollouts`` a response may span versions: each token records the version that sampled it
and the engine's log-prob. No KV cache outlives an update (the fleet resets the engines' prefix caches with every
update; a round recomputes what it needs). The round's sampling seed is derived from ``(--seed, round)``, so a
run whose updates land at fixed rounds (``--deterministic-mode``) samples the same tokens again, resumed too.

What is estimated when tokens come from several versions: docs/algorithm.md §5.2. This module holds the state and
its rules; :mod:`megatron_pacs.streaming` runs it beside the trainer.

Legend: B groups per step, n group size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.sources.base import StepRollouts, rollout_metrics
from megatron_pacs.utils.logging import get_logger
from megatron_pacs.utils.run_failure import RunFailure
from megatron_pacs.utils.seeding import STREAM_SAMPLING_STREAM, derive_seed

__all__ = ["RolloutStream", "StreamGroup", "StreamResponse"]

log = get_logger("stream")

Generate = Callable[[list[list[int]], Any], list[Any]]
"""The fleet's ``generate(prompts, sampling)`` (token-id prompts; one group of one response each)."""
Score = Callable[[list[str], list[str]], Any]
"""The reward pool's ``score(texts, truths)``."""


@dataclass
class StreamResponse:
    """One response being generated: its tokens so far, with the engine's log-prob and the weights' version of each.

    Attributes:
        tokens: The sampled token ids.
        logprobs: ``[len(tokens)]`` the engine's log-probs.
        versions: ``[len(tokens)]`` the version of the weights that sampled each token.
        finish: ``stop`` or ``length`` once finished; ``""`` while it is still open.
        routing: ``--router-replay r3``: each round's ``[rows, layers, k]`` int16 slice of the engine's routing,
            together ``[P + len(tokens) - 1, layers, k]``: every position from the round that sampled the token
            after it, the prompt's from the first round (see :meth:`RolloutStream.apply_round`).
    """

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    routing: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StreamGroup:
    """One prompt's n responses in the stream.

    Attributes:
        uid: Admission order since the run's start.
        row: The prompt.
        prompt: Its token ids (chat template applied).
        version: The weights' version when it was admitted.
        deadline: The last step that may train it (``version + K + 1``).
        responses: Its n responses.
        rewards: ``[n]`` once every response finished and was scored.
        texts: ``[n]`` the decoded responses, once scored.
        done_round: The round that finished it (-1 before).
    """

    uid: int
    row: PromptRow
    prompt: list[int]
    version: int
    deadline: int
    responses: list[StreamResponse]
    rewards: list[float] | None = None
    texts: list[str] | None = None
    done_round: int = -1

    @property
    def finished(self) -> bool:
        return all(r.finish for r in self.responses)


@dataclass
class _Counters:
    admitted: int = 0  # groups admitted since the run's start
    released: int = 0  # of those, dropped or filtered (their budget is free again)
    dropped: int = 0
    filtered: int = 0
    rounds: int = 0
    paced: int = 0  # rounds that found the budget full while prompts waited


class RolloutStream:
    """The asynchronous stream's groups and rules (not thread-safe: :mod:`megatron_pacs.streaming` locks it).

    Args:
        cfg: The run's settings (``TrainConfig``).
        tokenizer: The model's tokenizer (chat template, end of sequence, decoding the responses for the reward).
        draw: ``draw(k)``: the next k prompts of the stream (the loader's ``next_batch``).
    """

    def __init__(self, cfg: Any, tokenizer: Any, draw: Callable[[int], list[PromptRow]]) -> None:
        r, b = cfg.rollout, cfg.batch
        self.cfg, self.tokenizer, self.draw = cfg, tokenizer, draw
        self.k, self.batch_size, self.n = int(r.max_staleness), b.global_batch_size, b.group_size
        self.round_tokens = r.rollout_round_tokens if r.partial_rollouts else b.max_response_length
        self.filter = cfg.source.filter_groups == "zero-variance"
        self.max_filter_rounds = cfg.source.max_filter_rounds
        self._filtered_at_take = 0
        self._told = 0  # the batches of filtered groups the last "still waiting" line counted (no limit)
        self.groups: list[StreamGroup] = []  # admitted, not yet taken or released, in admission order
        self.counters = _Counters()
        eos = tokenizer.eos_token_id
        self.eos = [eos] if eos is not None else []

    # -- admission ---------------------------------------------------------------------------------------------

    def budget(self, version: int) -> int:
        """How many more groups may be admitted under weights ``version`` (pacing)."""
        c = self.counters
        return (version + self.k + 1) * self.batch_size - (c.admitted - c.released)

    def admit(self, version: int) -> int:
        """Admit as many prompts as the budget allows (at most one batch per draw); returns how many."""
        budget, admitted = self.budget(version), 0
        while budget > 0:
            rows = self.draw(min(budget, self.batch_size))
            for row in rows:
                uid = self.counters.admitted
                prompt = list(apply_chat_template(self.tokenizer, row.prompt))
                responses = [StreamResponse() for _ in range(self.n)]
                self.groups.append(StreamGroup(uid, row, prompt, version, version + self.k + 1, responses))
                self.counters.admitted += 1
            admitted += len(rows)
            budget -= len(rows)
        return admitted

    # -- rounds ------------------------------------------------------------------------------------------------

    def open_responses(self) -> list[tuple[StreamGroup, int]]:
        """The responses still open, ``(group, j)`` in admission then sample order (a round's order)."""
        return [(g, j) for g in self.groups for j, r in enumerate(g.responses) if not r.finish]

    def round_request(self) -> tuple[list[tuple[StreamGroup, int]], list[list[int]], Any]:
        """The next round: which responses, their prompts (prompt + tokens so far) and the sampling settings."""
        from megatron_pacs.rollout.types import SamplingConfig

        todo = self.open_responses()
        prompts = [g.prompt + g.responses[j].tokens for g, j in todo]
        r = self.cfg.rollout
        sampling = SamplingConfig(
            n=1,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=self.round_tokens,
            seed=derive_seed(self.cfg.run.seed, STREAM_SAMPLING_STREAM, self.counters.rounds),
            stop_token_ids=self.eos,
            logprobs=True,
        )
        return todo, prompts, sampling

    def apply_round(self, todo: Sequence[tuple[StreamGroup, int]], outputs: Sequence[Any], version: int) -> list:
        """Append a round's tokens (sampled under ``version``); returns the groups it finished (to be scored).

        Groups released while the round ran (dropped) are skipped. With ``--router-replay r3`` the engine returns the
        routing of every position it ran (``[Q + n - 1, layers, k]`` for a request of Q tokens and n new ones); the
        response keeps the rows whose output sampled this round's tokens (from the first round, the prompt's too).
        """
        limit = self.cfg.batch.max_response_length
        live = {id(g) for g in self.groups}
        finished = []
        for (g, j), out in zip(todo, outputs, strict=True):
            if id(g) not in live:
                continue
            resp, sample = g.responses[j], out.responses[0]
            room = limit - len(resp.tokens)
            ids = list(sample.token_ids)[:room]
            lps = list(sample.logprobs)[: len(ids)] if len(sample.logprobs) >= len(ids) else [float("nan")] * len(ids)
            routed = getattr(sample, "routed_experts", None)
            if routed is not None and ids:
                start = len(g.prompt) + len(resp.tokens) - 1 if resp.tokens else 0
                resp.routing.append(routed[start : len(g.prompt) + len(resp.tokens) + len(ids) - 1].to(torch.int16))
            resp.tokens += ids
            resp.logprobs += lps
            resp.versions += [version] * len(ids)
            if sample.finish_reason == "stop" and len(ids) == len(sample.token_ids):
                resp.finish = "stop"
            elif len(resp.tokens) >= limit:
                resp.finish = "length"
            if g.finished and g.done_round < 0:
                g.done_round = self.counters.rounds
                finished.append(g)
        self.counters.rounds += 1
        return finished

    def texts(self, groups: Sequence[StreamGroup]) -> tuple[list[str], list[str]]:
        """The finished groups' response texts and ground truths, for the reward pool."""
        texts = [self.tokenizer.decode(r.tokens, skip_special_tokens=True) for g in groups for r in g.responses]
        return texts, [g.row.ground_truth for g in groups for _ in g.responses]

    def scored(self, groups: Sequence[StreamGroup], texts: Sequence[str], scores: Sequence[float]) -> None:
        """Record the finished groups' rewards; with ``--filter-groups zero-variance`` release those all equal."""
        live = {id(g) for g in self.groups}
        for i, g in enumerate(groups):
            g.texts = list(texts[i * self.n : (i + 1) * self.n])
            g.rewards = [float(s) for s in scores[i * self.n : (i + 1) * self.n]]
            if self.filter and id(g) in live and len(set(g.rewards)) == 1:
                self._release(g)
                self.counters.filtered += 1

    def _release(self, group: StreamGroup) -> None:
        self.groups.remove(group)
        self.counters.released += 1

    # -- taking a step's groups --------------------------------------------------------------------------------

    def ready(self) -> list[StreamGroup]:
        """Finished, scored groups, in the order a step takes them: earliest deadline, then finished first."""
        done = (g for g in self.groups if g.rewards is not None)
        return sorted(done, key=lambda g: (g.deadline, g.done_round, g.uid))

    def _late(self, step: int, chosen: Sequence[StreamGroup]) -> int | None:
        """The earliest deadline d that the groups left after step ``step`` takes ``chosen`` would miss: more of
        them due by d than steps ``step + 1 .. d`` take (B each). None when every group can still make its own.

        Taking the finished groups first is not enough by itself: a step that takes groups due later, because
        those finished while earlier ones still generate, leaves more groups due at one step than it can take, and
        the rest would be trained past their deadline (K + 1 updates old).
        """
        taken = {id(g) for g in chosen}
        left = sorted(g.deadline for g in self.groups if id(g) not in taken)
        for i, d in enumerate(left):
            if (i + 1 == len(left) or left[i + 1] != d) and i + 1 > (d - step) * self.batch_size:
                return d
        return None

    def _choice(self, step: int) -> list[StreamGroup]:
        """Step ``step``'s B groups (the earliest deadlines among the finished), or none while it must wait."""
        chosen = self.ready()[: self.batch_size]
        if len(chosen) < self.batch_size or self.due_open(step):
            return []
        return chosen

    def due_open(self, step: int) -> list[StreamGroup]:
        """The groups not finished and scored that step ``step`` waits for: those due by the earliest deadline the
        remaining groups would miss if it took the finished ones now (at the least, those due by ``step``)."""
        late = self._late(step, self.ready()[: self.batch_size])
        if late is None:  # (with every group due by then finished, there is nothing to wait for: it takes them)
            return []
        return [g for g in self.groups if g.deadline <= late and g.rewards is None]

    def takeable(self, step: int) -> bool:
        """Step ``step`` can take its B groups now, leaving every other group able to make its deadline."""
        return bool(self._choice(step))

    def drop_due(self, step: int) -> int:
        """``--staleness-policy drop``: release the groups that step ``step`` would wait for and that could not all
        make their deadline (the excess of :meth:`due_open`, latest admitted first); returns how many."""
        chosen = self.ready()[: self.batch_size]
        late = self._late(step, chosen)
        if late is None:
            return 0
        taken = {id(g) for g in chosen}
        due = [g for g in self.groups if id(g) not in taken and g.deadline <= late]
        excess = len(due) - max(0, late - step) * self.batch_size
        still_open = sorted((g for g in due if g.rewards is None), key=lambda g: g.uid, reverse=True)[:excess]
        for g in still_open:
            self._release(g)
        self.counters.dropped += len(still_open)
        return len(still_open)

    def take(self, step: int) -> list[StreamGroup]:
        """Remove and return step ``step``'s B groups (:meth:`takeable` must hold)."""
        chosen = self._choice(step)
        assert chosen, f"step {step}: not takeable"
        for g in chosen:
            self.groups.remove(g)
        self._filtered_at_take = self.counters.filtered
        self._told = 0
        return chosen

    def check_filtering(self, step: int) -> None:
        """Raise when step ``step`` has filtered more groups than ``--max-filter-rounds`` batches while waiting for
        its own: a policy that solves every prompt, or none, leaves no group to train on. Without a limit (0), say
        that the step is still waiting after 8, 16, 32, ... batches' worth of filtered groups.

        Raises:
            RunFailure: naming the flag.
        """
        filtered = self.counters.filtered - self._filtered_at_take
        if not self.filter:
            return
        if self.max_filter_rounds and filtered > self.max_filter_rounds * self.batch_size:
            raise RunFailure(
                f"step {step}: --filter-groups zero-variance: {filtered} groups in a row had equal rewards while the "
                f"step waited for {self.batch_size} (more than --max-filter-rounds {self.max_filter_rounds} batches); "
                "look at the rewards (a policy that solves every prompt, or none, leaves no group to train on), or "
                "raise --max-filter-rounds"
            )
        batches = filtered // self.batch_size
        if not self.max_filter_rounds and batches >= 8 and batches & (batches - 1) == 0 and batches > self._told:
            self._told = batches
            log.warning(
                "step %d: --filter-groups zero-variance: still waiting, %d groups in a row had equal rewards "
                "(--max-filter-rounds 0: no limit; a policy that solves every prompt, or none, never fills the step)",
                step,
                filtered,
            )

    def stuck(self, version: int) -> bool:
        """Nothing to generate: no open response, and the budget admits no prompt."""
        return not self.open_responses() and self.budget(version) <= 0

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every admitted group not yet trained (finished, partial, pending), the counters, and where the filtered
        count stood when the last step took its groups (what :meth:`check_filtering` counts from): a deep copy."""
        return {
            "groups": copy.deepcopy(self.groups),
            "counters": copy.deepcopy(self.counters),
            "filtered_at_take": self._filtered_at_take,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups, self.counters = copy.deepcopy(state["groups"]), copy.deepcopy(state["counters"])
        # a checkpoint written before this key: count from the restored counters (never from zero)
        self._filtered_at_take = state.get("filtered_at_take", self.counters.filtered)
        self._told = 0


def stream_rollouts(groups: Sequence[StreamGroup], step: int, eos: Sequence[int]) -> StepRollouts:
    """A step's taken groups as the rollouts the trainer distributes, dumps and reports.

    Args:
        groups: The step's B finished, scored groups.
        step: The training step (its weights: version ``step - 1``).
        eos: The end-of-sequence token (an empty response scores one).

    Returns:
        The batch (with the engines' log-probs), with ``token_versions`` ``[sum R_i]`` and the staleness metrics:
        per token and per group (mean, max, in updates behind the weights that train them), the share of responses
        whose tokens span several versions.
    """
    sequences, prompt_lens, response_lens, rewards, records, finish = [], [], [], [], [], []
    logprobs: list[float] = []
    versions: list[int] = []
    routed: list[torch.Tensor | None] = []  # --router-replay r3
    empty, spanning = 0, 0
    for g in groups:
        assert g.rewards is not None and g.texts is not None
        for resp, reward, text in zip(g.responses, g.rewards, g.texts, strict=True):
            empty += not resp.tokens
            ids = resp.tokens or list(eos[:1]) or [0]
            logprobs += resp.logprobs if resp.tokens else [float("nan")]
            versions += resp.versions if resp.tokens else [g.version]
            spanning += len(set(resp.versions)) > 1
            routed.append(torch.cat(resp.routing) if resp.routing else None)
            sequences.append(g.prompt + ids)
            prompt_lens.append(len(g.prompt))
            response_lens.append(len(ids))
            rewards.append(reward)
            finish.append(resp.finish)
            records.append(
                {
                    "step": step,
                    "id": g.row.id,
                    "data_source": g.row.data_source,
                    "input": g.row.question,
                    "output": text,
                    "ground_truth": g.row.ground_truth,
                    "score": reward,
                    "versions": sorted(set(resp.versions)),
                }
            )
    given = next((r for r in routed if r is not None), None)
    if given is not None:  # an empty response has no routed row: all of its rows are marked missing (-1)
        routed = [torch.empty((0, *given.shape[1:]), dtype=torch.int16) if r is None else r for r in routed]
    batch = RolloutBatch.from_sequences(
        sequences,
        torch.tensor(prompt_lens),
        torch.tensor(response_lens),
        torch.tensor(rewards, dtype=torch.float32),
        len(groups[0].responses),
        engine_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        routed_experts=routed if given is not None else None,
    )
    metrics = rollout_metrics(batch, finish, empty_responses=empty)
    behind = (step - 1) - torch.tensor(versions, dtype=torch.float64)
    per_group = torch.tensor([(step - 1) - g.version for g in groups], dtype=torch.float64)
    metrics.update(
        {
            "rollout/staleness_token_mean": float(behind.mean()),
            "rollout/staleness_token_max": float(behind.max()),
            "rollout/staleness_group_mean": float(per_group.mean()),
            "rollout/staleness_group_max": float(per_group.max()),
            "rollout/spanning_responses": spanning / batch.num_responses,
        }
    )
    return StepRollouts(
        batch,
        records,
        metrics,
        prompt_ids=[g.row.id for g in groups],
        finish_reasons=finish,
        token_versions=torch.tensor(versions, dtype=torch.int32),
    )
