"""The asynchronous stream's rules (``--max-staleness``, ``--partial-rollouts``, ``--staleness-policy``), driven
round by round as :mod:`megatron_pacs.streaming` drives them, with a scripted engine.

The scripted engine stands in for the fleet only to pin the scheduling exactly: it emits token 5 and stops where a
hash of the sequence so far says so (memoryless lengths, a long tail), so every round's outcome is known without
sampling. The real fleet runs the same stream in tests/test_streaming.py. What is guarded: admission never exceeds
the budget, no trained token is more than K updates old, a response spans versions only with partial rollouts and
records each token's, a due group is waited for or dropped and counted, zero-variance groups are released and
refilled, and a snapshot taken mid-run continues exactly.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources.stream import RolloutStream, stream_rollouts
from megatron_pacs.utils.run_failure import RunFailure

ROWS = [
    PromptRow(
        id=f"p{i}", data_source="t", prompt=[{"role": "user", "content": f"q{i}"}], ground_truth="0", question="q"
    )
    for i in range(300)
]
B, N, LIMIT = 4, 2, 16


class Tokenizer:
    """The chat template is the prompt's digits as ids; id 2 ends a sequence."""

    eos_token_id = 2

    def apply_chat_template(self, messages, **_):
        return [10 + int(c) for c in messages[0]["content"][1:]]

    def decode(self, ids, **_):
        return "x" * len([i for i in ids if i != 2])


def scripted_generate(prompts, sampling):
    """One response per prompt: token 5 until a hash of the request's seed and the sequence so far stops it (then
    the end token)."""
    out = []
    for i, p in enumerate(prompts):
        ids, finish = [], "length"
        for _ in range(sampling.max_tokens):
            digest = hashlib.sha256(repr([sampling.seed + i, *p, *ids]).encode()).digest()
            if digest[0] % 6 == 0:
                ids.append(2)
                finish = "stop"
                break
            ids.append(5)
        resp = SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish)
        out.append(SimpleNamespace(responses=[resp]))
    return out


def _score(texts):
    return [float(len(t) % 2) for t in texts]


def _stream(k: int, *flags: str) -> tuple[RolloutStream, PromptLoader]:
    args = ["--max-staleness", str(k), "--global-batch-size", str(B), "--group-size", str(N)]
    args += ["--ppo-mini-batch-size", "2", "--max-response-length", str(LIMIT), "--max-prompt-length", "64", *flags]
    loader = PromptLoader(ROWS, B, seed=0)
    return RolloutStream(parse_config(args), Tokenizer(), loader.next_batch), loader


def _round(s: RolloutStream, version: int) -> None:
    s.admit(version)
    todo, prompts, sampling = s.round_request()
    if todo:
        s.apply_round(todo, scripted_generate(prompts, sampling), version)
    finished = [g for g in s.groups if g.finished and g.rewards is None]
    texts, _ = s.texts(finished)
    s.scored(finished, texts, _score(texts))


def _run(s: RolloutStream, steps: range, *, rounds_per_step: int = 1) -> list:
    """Each step: rounds until the step's groups can be taken (a due group waited for), take them, then
    ``rounds_per_step`` rounds under the same weights (the stream beside training), then the update."""
    taken = []
    for step in steps:
        version = step - 1
        for _ in range(200):
            if s.takeable(step):
                break
            _round(s, version)
        groups = s.take(step)
        assert max(g.deadline for g in groups) >= step and min(g.deadline for g in groups) >= step
        taken.append(stream_rollouts(groups, step, [2]))
        for _ in range(rounds_per_step):
            _round(s, version)
        c = s.counters
        assert c.admitted - c.released <= (version + s.k + 1) * B  # the budget is never exceeded
    return taken


@pytest.mark.parametrize("k", [0, 1, 3])
def test_no_trained_token_is_older_than_the_budget(k):
    s, _ = _stream(k, "--partial-rollouts", "--rollout-round-tokens", "3")
    steps = _run(s, range(1, 9), rounds_per_step=2)
    for r in steps:
        assert r.metrics["rollout/staleness_token_max"] <= k and r.metrics["rollout/staleness_group_max"] <= k
        assert r.batch.num_prompts == B and r.token_versions is not None
        assert r.token_versions.numel() == int(r.batch.response_lens.sum())
    ids = [i for r in steps for i in r.prompt_ids]
    assert len(ids) == len(set(ids))  # none trained twice
    if k == 0:
        assert all(r.metrics["rollout/staleness_token_mean"] == 0 for r in steps)
    else:  # later steps train on older weights, and partial rollouts span versions
        assert max(r.metrics["rollout/staleness_token_max"] for r in steps) == k
        assert any(r.metrics["rollout/spanning_responses"] > 0 for r in steps)


def test_without_partial_rollouts_a_round_finishes_every_response():
    s, _ = _stream(2)
    steps = _run(s, range(1, 6), rounds_per_step=1)
    assert all(r.metrics["rollout/spanning_responses"] == 0 for r in steps)
    assert s.round_tokens == LIMIT


def test_router_replay_keeps_each_positions_routing_from_the_round_that_sampled_the_next_token():
    """--router-replay r3 with partial rollouts: each round the scripted engine returns a routing for every position
    it ran (``[Q + n - 1, 1, 1]``, the value ``1000 * round + position``, as vLLM's ``[prompt + response - 1,
    layers, k]``). The trained routing of a response that spans rounds takes each position from the round whose
    output at it sampled the next token, the prompt's from the first; it is token-aligned in the batch, and its last
    token (never run) is marked missing (-1). Without partial rollouts a response is one call, as in a synchronous
    step."""
    rounds, sampled_in = [], {}  # (group uid, j) -> the round of each of its tokens

    def routed_generate(prompts, sampling):
        out = scripted_generate(prompts, sampling)
        for p, o in zip(prompts, out, strict=True):
            q = len(p) + len(o.responses[0].token_ids) - 1
            o.responses[0].routed_experts = (1000 * len(rounds) + torch.arange(q)).reshape(q, 1, 1)
        rounds.append(len(prompts))
        return out

    for flags in (("--partial-rollouts", "--rollout-round-tokens", "3"), ()):
        rounds.clear()
        sampled_in.clear()
        s, _ = _stream(1, *flags)
        taken = []
        for step in (1, 2):
            while not s.takeable(step):
                s.admit(step - 1)
                todo, prompts, sampling = s.round_request()
                before = [len(g.responses[j].tokens) for g, j in todo]
                finished = s.apply_round(todo, routed_generate(prompts, sampling), step - 1)
                for (g, j), n in zip(todo, before, strict=True):
                    sampled_in.setdefault((g.uid, j), []).extend([len(rounds) - 1] * (len(g.responses[j].tokens) - n))
                texts, _ = s.texts(finished)
                s.scored(finished, texts, _score(texts))
            groups = s.take(step)
            taken.append((groups, stream_rollouts(groups, step, [2])))
        spanning = 0
        for groups, rollouts in taken:
            batch = rollouts.batch
            assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.int16
            i = 0
            for g in groups:
                for j, r in enumerate(g.responses):
                    routing = batch.routed_experts[int(batch.offsets[i]) : int(batch.offsets[i + 1]), 0, 0].tolist()
                    by_token, n = sampled_in[(g.uid, j)], len(g.prompt)
                    want = [1000 * by_token[0] + p for p in range(n)]  # the prompt's, and its last position's
                    want += [1000 * by_token[t + 1] + n + t for t in range(len(r.tokens) - 1)]
                    assert routing == [*want, -1], (routing, want)
                    spanning += len(set(by_token)) > 1
                    i += 1
        assert (spanning > 0) == bool(flags)


def test_a_due_group_is_dropped_and_counted_with_the_drop_policy():
    s, _ = _stream(0, "--partial-rollouts", "--rollout-round-tokens", "1", "--staleness-policy", "drop")
    _round(s, 0)  # one token each: no group has finished
    assert s.due_open(1) and not s.takeable(1)
    dropped = s.drop_due(1)
    assert dropped == B and s.counters.dropped == B and not s.groups
    assert s.budget(0) == B  # their budget is free: B new prompts are admitted at once
    _round(s, 0)
    assert [g.uid for g in s.groups] == list(range(B, 2 * B))


def test_zero_variance_groups_are_released_and_refilled():
    s, loader = _stream(1, "--partial-rollouts", "--filter-groups", "zero-variance")
    steps = _run(s, range(1, 7))
    filtered = s.counters.filtered
    assert filtered > 0
    for r in steps:
        assert not (r.batch.rewards.view(-1, N) == r.batch.rewards.view(-1, N)[:, :1]).all(dim=1).any()
    trained = [i for r in steps for i in r.prompt_ids]
    drawn = loader.state_dict()["position"]
    assert drawn == len(trained) + filtered + len(s.groups)  # each drawn prompt: trained, filtered, or still live


def test_a_snapshot_continues_exactly():
    a, loader_a = _stream(2, "--partial-rollouts", "--rollout-round-tokens", "3")
    _run(a, range(1, 4), rounds_per_step=1)
    saved, position = a.state_dict(), loader_a.state_dict()
    whole = _run(a, range(4, 8), rounds_per_step=1)
    b, loader_b = _stream(2, "--partial-rollouts", "--rollout-round-tokens", "3")
    loader_b.load_state_dict(position)
    b.load_state_dict(saved)
    tail = _run(b, range(4, 8), rounds_per_step=1)
    for x, y in zip(whole, tail, strict=True):
        assert x.prompt_ids == y.prompt_ids
        assert torch.equal(x.batch.token_ids, y.batch.token_ids) and torch.equal(x.token_versions, y.token_versions)


def test_refused_combinations_name_their_flags(capsys):
    base = ["--global-batch-size", "4", "--group-size", "2", "--ppo-mini-batch-size", "2"]
    for extra, message in (
        (["--partial-rollouts"], "--partial-rollouts: only means something with --max-staleness"),
        (["--max-staleness", "2", "--off-policy-steps", "1"], "--off-policy-steps: --max-staleness 2 already"),
        (["--max-staleness", "-1"], "--max-staleness: -1"),
        (["--max-staleness", "1", "--rollout-round-tokens", "8"], "--rollout-round-tokens: sizes the rounds"),
    ):
        with pytest.raises(SystemExit):
            parse_config([*base, *extra])
        assert message in capsys.readouterr().err


def test_a_stream_whose_every_group_is_filtered_fails_naming_the_flag():
    """Every reward equal: each finished group is released and another admitted; past --max-filter-rounds batches
    the step fails, naming the flag, instead of waiting for ever."""
    s, _ = _stream(0, "--filter-groups", "zero-variance", "--max-filter-rounds", "2")
    for _ in range(3):
        s.admit(0)
        todo, prompts, sampling = s.round_request()
        s.apply_round(todo, scripted_generate(prompts, sampling), 0)
        finished = [g for g in s.groups if g.finished and g.rewards is None]
        s.scored(finished, ["x"] * (len(finished) * N), [1.0] * (len(finished) * N))
    assert s.counters.filtered == 3 * B and not s.takeable(1)
    with pytest.raises(RunFailure, match=r"step 1: --filter-groups zero-variance: 12 groups .*--max-filter-rounds 2"):
        s.check_filtering(1)


def test_a_stream_without_a_filter_limit_says_it_is_still_waiting(caplog):
    """Issue 53, item 5: with --max-filter-rounds 0 a stream whose every group is filtered waited silently for ever;
    it now says so after 8, 16, ... batches' worth of filtered groups, once each however often the step wakes."""
    s, _ = _stream(0, "--filter-groups", "zero-variance", "--max-filter-rounds", "0")
    with caplog.at_level("WARNING", logger="megatron_pacs.stream"):
        while s.counters.filtered < 16 * B:
            s.admit(0)
            todo, prompts, sampling = s.round_request()
            s.apply_round(todo, scripted_generate(prompts, sampling), 0)
            finished = [g for g in s.groups if g.finished and g.rewards is None]
            s.scored(finished, ["x"] * (len(finished) * N), [1.0] * (len(finished) * N))
            s.check_filtering(1)
            s.check_filtering(1)  # the step wakes again: nothing new to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(
        "still waiting" in line and "--max-filter-rounds 0: no limit" in line for line in lines
    )


def test_the_stream_thread_generates_nothing_before_the_first_step_takes_its_groups():
    """megatron_pacs.streaming, with this module's scripted engine: under --deterministic-mode the thread runs rounds
    until the next step can take its groups, whatever the trainer's timing, but none before the first step takes
    its own. Until then the fleet is the start's validation's: a round beside it made the chunks, and so the samples,
    depend on which call the engines served first."""
    import threading
    import time

    from megatron_pacs.streaming import StreamProducer

    calls = []

    def generate(prompts, sampling):
        calls.append(threading.current_thread().name)
        return scripted_generate(prompts, sampling)

    args = ["--max-staleness", "1", "--global-batch-size", str(B), "--group-size", str(N), "--deterministic-mode"]
    args += ["--ppo-mini-batch-size", "2", "--max-response-length", str(LIMIT), "--max-prompt-length", "64"]
    score = lambda texts, truths: SimpleNamespace(scores=_score(texts))  # noqa: E731
    producer = StreamProducer(parse_config(args), Tokenizer(), generate, score)
    producer.start(PromptLoader(ROWS, B, seed=0))
    try:
        time.sleep(0.3)
        assert calls == []
        gen = producer.rollouts(None, 1, 0)
        assert gen.rollouts.batch.num_prompts == B and set(calls) == {"rollout-stream"}
    finally:
        assert producer.close(timeout=10)


def _finish(groups) -> None:
    """Mark ``groups`` finished and scored, as a round and the scorer would."""
    for g in groups:
        for r in g.responses:
            r.tokens, r.logprobs, r.versions, r.finish = [5, 2], [-0.5, -0.5], [g.version] * 2, "stop"
        g.rewards, g.texts, g.done_round = [0.0, 1.0], ["x", "y"], 0


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_a_step_takes_no_later_group_that_would_leave_earlier_ones_past_their_deadline(policy):
    """K=2: 3B groups admitted under the first weights, all due by step 3. Step 1 takes B of them; B more are
    admitted, due by step 4, and finish while the 2B earlier ones still generate. Taking those B at step 2 would
    leave 2B groups due at step 3, which takes B: half of them would train 3 updates old (found by the benchmark
    with 192-token responses: staleness 5 under K=4). Step 2 waits for B of the earlier ones instead, or with
    --staleness-policy drop releases the excess B (counted)."""
    s, _ = _stream(2, "--partial-rollouts", "--staleness-policy", policy)
    s.admit(0)
    _finish(s.groups[:B])
    s.take(1)
    assert s.admit(1) == B
    early, later = s.groups[: 2 * B], s.groups[2 * B :]
    assert {g.deadline for g in early} == {3} and {g.deadline for g in later} == {4}
    _finish(later)
    assert not s.takeable(2) and s.due_open(2) == early  # the earlier ones are not due yet, but needed now
    if policy == "drop":
        assert s.drop_due(2) == B and s.counters.dropped == B and s.groups[:B] == early[:B]
    else:
        _finish(early[:B])
    assert s.takeable(2) and s.take(2) == (later if policy == "drop" else early[:B])
    if policy == "wait":
        assert not s.takeable(3) and s.due_open(3) == early[B:]
        _finish(early[B:])
        assert s.take(3) == early[B:]  # trained by its deadline: 2 updates old


def test_a_failure_of_the_stream_thread_is_raised_by_the_next_step_not_by_the_drain():
    """megatron_pacs.streaming, with this module's scripted engine standing in for a fleet whose rollout cluster
    is lost for good once step 1 has taken its groups (its generate raises RolloutClusterLost from then on). The
    drain before the weight sync must not raise it: the other ranks are in the sync's gathers then, and would wait
    for the driver there. It is raised by the next step's rollouts (where every rank waits for the driver's: the
    stop reaches them), and the snapshot the drain keeps for the step's checkpoint is the stream as the last round
    that succeeded left it."""
    from megatron_pacs.rollout.lost import RolloutClusterLost
    from megatron_pacs.streaming import StreamProducer

    failed = []

    def generate(prompts, sampling):
        if producer._next_step > 1:  # step 1 took its groups (set before the thread is woken for the next round)
            failed.append(len(prompts))
            raise RolloutClusterLost("the rollout cluster at ray://h:10001 was lost")
        return scripted_generate(prompts, sampling)

    args = ["--max-staleness", "1", "--global-batch-size", str(B), "--group-size", str(N), "--partial-rollouts"]
    args += ["--ppo-mini-batch-size", "2", "--max-response-length", str(LIMIT), "--max-prompt-length", "64"]
    # rounds until step 2 could take its groups, which are still generating when step 1 takes its own
    args += ["--rollout-round-tokens", "4", "--deterministic-mode"]
    score = lambda texts, truths: SimpleNamespace(scores=_score(texts))  # noqa: E731
    producer = StreamProducer(parse_config(args), Tokenizer(), generate, score)
    producer.start(PromptLoader(ROWS, B, seed=0))
    try:
        producer.rollouts(None, 1, 0)
        producer.drain()  # waits for the failed round beside step 1's update; must not raise
        assert len(failed) == 1
        kept = producer.kept(1)
        assert kept is not None and kept["stream"]["counters"].rounds == producer.stream.counters.rounds
        responses = [r for g in kept["stream"]["groups"] for r in g.responses]
        assert any(not r.finish for r in responses)
        assert all(len(r.tokens) == len(r.versions) == len(r.logprobs) for r in responses)
        with pytest.raises(RolloutClusterLost, match="was lost"):
            producer.rollouts(None, 2, 1)
    finally:
        assert producer.close(timeout=10)


def test_the_stream_metrics_of_a_resumed_run_are_the_uninterrupted_run_s():
    """Issue 53, item 7: the first step after a resume reported ``rollout/stream_rounds`` (and the dropped and
    filtered groups) since the run's start (9 instead of 3): the restored counters came back, and the baseline of
    the step's deltas started at zero. megatron_pacs.streaming with this module's scripted engine, driven as the
    trainer's step drives it (take, drain, metrics), uninterrupted and resumed from step 1's snapshot, under
    --deterministic-mode (the same rounds at every update): the same metrics each step. In-process, about 0.5 s."""
    from megatron_pacs.streaming import StreamProducer

    args = ["--max-staleness", "1", "--global-batch-size", str(B), "--group-size", str(N), "--partial-rollouts"]
    args += ["--ppo-mini-batch-size", "2", "--max-response-length", str(LIMIT), "--max-prompt-length", "64"]
    args += ["--rollout-round-tokens", "4", "--deterministic-mode", "--filter-groups", "zero-variance"]
    score = lambda texts, truths: SimpleNamespace(scores=_score(texts))  # noqa: E731
    keys = ("rollout/stream_rounds", "rollout/filtered_groups", "rollout/dropped_groups")

    def run(steps, state=None):
        producer = StreamProducer(parse_config(args), Tokenizer(), scripted_generate, score)
        loader = PromptLoader(ROWS, B, seed=0)
        if state is not None:
            loader.load_state_dict(state["loader"])
            producer.restore(state, steps[0] - 1)
        producer.start(loader)
        out, kept = [], []
        try:
            for step in steps:
                gen = producer.rollouts(None, step, step - 1)
                producer.drain()
                kept.append(producer.kept(step))  # what the step's checkpoint saves
                metrics = producer.step_metrics(gen, (0.0, 1.0), (0.0, 1.0))
                out.append({k: metrics[k] for k in keys})
            return out, kept[0]
        finally:
            assert producer.close(timeout=10)

    whole, first = run([1, 2, 3])
    assert first is not None
    resumed, _ = run([2, 3], first)
    assert resumed == whole[1:]
    assert whole[1]["rollout/stream_rounds"] > 0 and sum(m["rollout/filtered_groups"] for m in whole) > 0
