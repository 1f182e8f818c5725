"""megatron_pacs.planner: exact parameter counts, flag-naming configuration errors, the memory model, the dry run."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_pacs.planner as planner
from megatron_pacs.compute_plan import format_compute
from megatron_pacs.config import TrainConfig, flag, parse_config
from megatron_pacs.planner import ModelShape, RunPlan, dry_run, plan_run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
)


def _hf_count(config) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_param_count_matches_transformers(tied):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, tie_word_embeddings=tied)
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert shape.qkv_bias and not shape.o_bias
    assert shape.num_params() == _hf_count(cfg)
    layers = shape.num_hidden_layers * shape.layer_params()
    assert shape.num_params() == layers + shape.embedding_params() + shape.output_layer_params() + TINY["hidden_size"]


@pytest.mark.parametrize("bias", [False, True])
def test_llama_param_count_matches_transformers(bias):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=bias, mlp_bias=bias)
    assert ModelShape.from_hf_config(cfg.to_dict()).num_params() == _hf_count(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_param_count_matches_transformers(tied):
    from transformers import Qwen3Config

    cfg = Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=tied)  # head_dim != hidden / heads
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert shape.head_dim == 24 and shape.qk_norm
    assert shape.num_params() == _hf_count(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_moe_param_count_matches_transformers(tied):
    from transformers import Qwen3MoeConfig

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40)
    cfg = Qwen3MoeConfig(**TINY, **moe, head_dim=24, tie_word_embeddings=tied)  # pyright: ignore[reportCallIssue]
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert shape.qk_norm and shape.num_experts == 8 and shape.expert_layer_params() == 8 * 3 * 64 * 40
    assert shape.num_params() == _hf_count(cfg)


def test_experts_split_over_ep_and_their_optimizer_state_over_expert_data_parallel():
    """Per GPU: attention and norms as a dense model's; each layer's experts divided by EP (whole on every TP
    rank), their Adam state sharded over the ranks holding the same experts (DP x TP / EP)."""
    from transformers import Qwen3MoeConfig

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40)
    shape = ModelShape.from_hf_config(Qwen3MoeConfig(**TINY, **moe, tie_word_embeddings=False).to_dict())
    plan = _plan(shape, tp=1, sequence_parallel=False, world_size=8)
    one = planner._stage_memory(plan, "only", 0)
    plan.ep = 2
    two = planner._stage_memory(plan, "only", 0)
    experts = shape.num_hidden_layers * shape.expert_layer_params()
    assert one.params_per_gpu == shape.num_params() and two.params_per_gpu == one.params_per_gpu - experts // 2
    gib = 1024**3
    dense = one.params_per_gpu - experts
    assert two.adam_gb == pytest.approx(8 * (dense / 8 + experts / 2 / 4) / gib)  # DP 8; expert DP 8 x 1 / 2
    assert "EP 2 (4 of 8 experts per rank)" in plan.format()


def test_shipped_configs_have_the_public_sizes():
    assert ModelShape.from_pretrained(EXAMPLES / "qwen2.5-7b").num_params() == 7_615_616_512
    assert ModelShape.from_pretrained(EXAMPLES / "qwen2.5-3b").num_params() == 3_085_938_688


def test_missing_config_field_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"model_type": "qwen2"})


def _script_flag(script: str, option: str) -> int:
    # A script's own flags first, then the recipe every multi-node script shares.
    text = (EXAMPLES / script).read_text() + (EXAMPLES / "lib" / "recipe.bash").read_text()
    m = re.search(rf"{option} (\d+)", text)
    assert m, f"{script} sets no {option}"
    return int(m.group(1))


# Short names the tests override, as config fields (every other name is a field already).
FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "fp8": "fp8_format",
    "rollout_tp": "rollout_tensor_parallel_size",
}


def _recipe_flags(script: str = "qwen2.5-7b/pacs.sh", **overrides) -> list[str]:
    """The reference recipe (docs/algorithm.md §10.1) with the layout the launch script uses, as trainer flags.

    ``overrides`` are config fields (or the short names in ``FIELDS``); None leaves a flag out, so its default holds.
    """
    tp = _script_flag(script, "--tensor-model-parallel-size")
    values = dict(
        tp=tp,
        pp=_script_flag(script, "--pipeline-model-parallel-size"),
        sequence_parallel=tp > 1,
        global_batch_size=1024,
        group_size=8,
        ppo_mini_batch_size=256,
        ppo_epochs=1,
        micro_batch_size=1,
        max_tokens_per_microbatch=_script_flag(script, "--max-tokens-per-microbatch"),
        max_prompt_length=512,
        max_response_length=4096,
        bf16=True,
        use_distributed_optimizer=True,
        recompute_activations=True,
        num_engines=32,
        rollout_tp=2,
    )
    values.update(overrides)
    if values.get("vpp"):  # the only settings under which Megatron interleaves correctly (ParallelConfig insists)
        values.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    argv = []
    for name, value in values.items():
        option = flag(FIELDS.get(name, name))
        if isinstance(value, bool):
            argv.append(option if value else "--no-" + option[2:])
        elif value is not None:
            argv += [option, str(value)]
    return argv


def _config(script: str = "qwen2.5-7b/pacs.sh", **overrides) -> TrainConfig:
    """The recipe as the trainer's command line parses it."""
    return parse_config(_recipe_flags(script, **overrides))


def _plan(shape: ModelShape, script: str = "qwen2.5-7b/pacs.sh", *, world_size: int = 64, **overrides) -> RunPlan:
    return plan_run(shape, _config(script, **overrides), world_size=world_size)


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    return ModelShape.from_pretrained(EXAMPLES / "qwen2.5-7b")


@pytest.mark.parametrize("script", ["qwen2.5-7b/pacs.sh", "qwen2.5-7b/grpo.sh"])
def test_7b_recipe_layout_fits_and_has_four_optimizer_steps(qwen7b, script):
    plan = _plan(qwen7b, script)
    assert plan.optimizer_steps_per_step == 4
    assert plan.responses_per_step == 8192
    assert plan.dp * plan.tp * plan.pp == 64
    assert plan.responses_per_dp_rank_per_minibatch == 256 * 8 // plan.dp
    assert plan.memory.total_gb < 0.9 * 80 and not plan.warnings
    text = plan.format()
    assert "total memory" in text and "world size 64" in text and "WARNING" not in text


@pytest.mark.parametrize("script", ["qwen2.5-3b/pacs.sh", "qwen2.5-3b/grpo.sh"])
def test_3b_recipe_layout_fits(script):
    plan = _plan(ModelShape.from_pretrained(EXAMPLES / "qwen2.5-3b"), script)
    assert plan.optimizer_steps_per_step == 4 and plan.memory.total_gb < 0.9 * 80 and not plan.warnings


def test_memory_drops_with_distributed_optimizer_and_recompute(qwen7b):
    base = _plan(qwen7b, use_distributed_optimizer=False, recompute_activations=False).memory
    dist = _plan(qwen7b, recompute_activations=False).memory
    both = _plan(qwen7b).memory
    assert dist.adam_gb == pytest.approx(base.adam_gb / 32) and dist.main_params_gb < base.main_params_gb
    assert dist.grads_gb == base.grads_gb  # Megatron DDP's grad buffer is never sharded
    assert both.activations_gb + both.recompute_gb < dist.activations_gb
    assert base.total_gb > dist.total_gb > both.total_gb


def test_memory_components_follow_the_accounting(qwen7b):
    plan = _plan(qwen7b, tp=1, sequence_parallel=False, use_distributed_optimizer=False)
    m, n = plan.memory, qwen7b.num_params()
    assert m.params_per_gpu == n
    gib = 1024**3
    assert (m.weights_gb, m.main_params_gb, m.grads_gb, m.adam_gb) == pytest.approx(
        (2 * n / gib, 4 * n / gib, 4 * n / gib, 8 * n / gib)
    )
    sbh = 16384 * qwen7b.hidden_size
    assert m.activations_gb == pytest.approx(2 * sbh * 28 / gib)  # recompute keeps each layer's input
    assert m.recompute_gb == pytest.approx(34 * sbh / gib)
    fp32 = _plan(qwen7b, tp=1, sequence_parallel=False, bf16=False).memory
    assert fp32.main_params_gb == 0 and fp32.weights_gb == pytest.approx(2 * m.weights_gb)
    assert m.reference_gb == 0  # no reference policy in this run
    ref = _plan(qwen7b, tp=1, sequence_parallel=False, use_distributed_optimizer=False, kl_coef=0.001)
    assert ref.memory.reference_gb == pytest.approx(m.weights_gb)  # a frozen bf16 copy of the actor's shard
    assert ref.memory.total_gb == pytest.approx(m.total_gb + m.weights_gb)
    assert "reference policy weights" in ref.format()


def test_pipeline_stages_and_micro_batches(qwen7b):
    plan = _plan(qwen7b, tp=2, pp=4, max_tokens_per_microbatch=None, micro_batch_size=2)
    first, last = plan.stages
    assert (first.stage, last.stage) == ("first", "last")
    assert first.in_flight_micro_batches == 4 and last.in_flight_micro_batches == 1
    assert last.logits_gb > 0 and first.logits_gb == 0
    assert plan.micro_batches_per_minibatch == 256 * 8 // 8 // 2  # DP 8: 256 responses per rank, 2 per micro-batch
    vpp = _plan(qwen7b, tp=2, pp=2, vpp=2, max_tokens_per_microbatch=None, micro_batch_size=2)
    assert vpp.stages[0].in_flight_micro_batches == (2 * 1 + 1 * 2 + 1) / 2  # Megatron's interleaved warm-up


def test_memory_over_budget_warns_instead_of_raising(qwen7b):
    plan = _plan(qwen7b, tp=1, sequence_parallel=False, use_distributed_optimizer=False, recompute_activations=False)
    assert plan.memory.total_gb > 80 and plan.warnings
    assert "WARNING" in plan.format()


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (dict(world_size=0), "--world-size"),
        (dict(tp=3, sequence_parallel=True), "--tensor-model-parallel-size"),  # 64 % 3 (TrainConfig.validate)
        (dict(world_size=48, tp=3, sequence_parallel=True, ppo_mini_batch_size=256), "--tensor-model-parallel-size"),
        (dict(tp=8), "--tensor-model-parallel-size"),  # 4 kv heads
        (dict(tp=1, pp=3, world_size=48, sequence_parallel=False), "--pipeline-model-parallel-size"),  # 28 layers
        (dict(tp=2, pp=2, vpp=4), "--virtual-pipeline-model-parallel-size"),  # 28 % 8
        (dict(ppo_mini_batch_size=16, global_batch_size=1024), "--ppo-mini-batch-size"),  # DP 32 (TrainConfig.validate)
        (dict(rollout_tp=3), "--rollout-tensor-parallel-size"),
        (
            dict(tp=2, pp=4, vpp=7, max_tokens_per_microbatch=None, micro_batch_size=256, sequence_packing=False),
            "--micro-batch-size",
        ),
    ],
)
def test_invalid_configurations_name_their_flag(qwen7b, overrides, option):
    with pytest.raises(ValueError, match=re.escape(option)) as e:
        _plan(qwen7b, **overrides)
    assert str(e.value).startswith(f"{option}: ") and ";" in str(e.value)  # "<flag>: <problem>; <fix>"


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (dict(vpp=2), "--virtual-pipeline-model-parallel-size"),  # PP 1
        (dict(tp=1, sequence_parallel=True), "--sequence-parallel"),
        (dict(global_batch_size=1000), "--ppo-mini-batch-size"),
        (dict(max_tokens_per_microbatch=4096), "--max-tokens-per-microbatch"),  # one sequence is 4608
        (dict(fp8="e4m3", bf16=False), "--fp8-format"),
        (dict(fp8="e5m2"), "--fp8-format"),
        (dict(micro_batch_size=0), "--micro-batch-size"),
    ],
)
def test_settings_the_config_refuses_name_their_flag(capsys, overrides, option):
    """What a config section refuses on its own stops the command line before any plan, naming the flag."""
    with pytest.raises(SystemExit) as e:
        _config(**overrides)
    assert e.value.code == 2
    assert f"error: {option}: " in capsys.readouterr().err


def test_vocab_not_divisible_by_tp_is_named():
    shape = ModelShape.from_hf_config(dict(TINY, model_type="qwen2", num_attention_heads=8, num_key_value_heads=8))
    with pytest.raises(ValueError, match="vocab_size=300"):
        _plan(shape, tp=8, world_size=64, num_engines=1, rollout_tp=1)


def test_dry_run_prints_the_plan(qwen7b, capsys):
    argv = [*_recipe_flags(), "--hf-model", str(EXAMPLES / "qwen2.5-7b"), "--dry-run", "--world-size", "64"]
    assert dry_run(parse_config(argv)) == 0
    plan = _plan(qwen7b)
    assert capsys.readouterr().out == plan.format() + "\n" + format_compute(plan, _config()) + "\n"
    missing = parse_config([*argv, "--hf-model", str(EXAMPLES / "no-such-model")])
    with pytest.raises(ValueError, match=r"--hf-model: .* has no config\.json"):
        dry_run(missing)


def test_planner_is_pure_arithmetic():
    tree = ast.parse(Path(planner.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "megatron", "ray", "vllm")}
    # ... and so is what it imports (the config): the dry run never loads a backend.
    code = "import sys, megatron_pacs.planner; print(*sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert not loaded & {"torch", "megatron", "ray", "vllm", "transformers", "numpy"}


@pytest.mark.parametrize("script", ["qwen2.5-7b/ppo.sh", "qwen2.5-3b/ppo.sh"])
def test_ppo_recipes_count_the_critic_and_fit(script):
    """The critic is a second trained model on the actor's layout: the actor's per-parameter bytes (weights, main
    params, grads, Adam) over its parameters, the LM head replaced by a [1, h] head and a bias; nothing else moves."""
    shape = ModelShape.from_pretrained(EXAMPLES / script.split("/")[0])
    ppo, grpo = _plan(shape, script, loss="ppo"), _plan(shape, script, loss="grpo")
    m, g = ppo.memory, grpo.memory
    lm_head = shape.vocab_size * shape.hidden_size / ppo.tp if not shape.tie_word_embeddings else 0
    critic_params = g.params_per_gpu - lm_head + shape.hidden_size + 1
    trained = g.weights_gb + g.main_params_gb + g.grads_gb + g.adam_gb
    assert m.critic_gb == pytest.approx(trained * critic_params / g.params_per_gpu, rel=1e-6)
    assert m.total_gb == pytest.approx(g.total_gb + m.critic_gb) and g.critic_gb == 0
    assert m.total_gb < 0.9 * 80 and not ppo.warnings
    assert "critic (weights, main params, grads, Adam)" in ppo.format()
