"""megatron_pacs.estimate: exact parameter counts, flag-naming configuration errors, and the memory model."""

import ast
import re
from pathlib import Path

import pytest

import megatron_pacs.estimate as estimate
from megatron_pacs.estimate import ModelShape, plan_run

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


def test_shipped_configs_have_the_public_sizes():
    assert ModelShape.from_pretrained(EXAMPLES / "qwen2.5-7b").num_params() == 7_615_616_512
    assert ModelShape.from_pretrained(EXAMPLES / "qwen2.5-3b").num_params() == 3_085_938_688


def test_missing_config_field_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"model_type": "qwen2"})


def _script_flag(script: str, flag: str) -> int:
    # A script's own flags first, then the recipe every multi-node script shares.
    text = (EXAMPLES / script).read_text() + (EXAMPLES / "lib" / "recipe.bash").read_text()
    m = re.search(rf"{flag} (\d+)", text)
    assert m, f"{script} sets no {flag}"
    return int(m.group(1))


def _recipe(script: str = "qwen2.5-7b/pacs.sh", **overrides) -> dict:
    """The reference recipe (spec Part B 2.3) with the layout the launch script uses."""
    tp = _script_flag(script, "--tensor-model-parallel-size")
    kw = dict(
        world_size=64,
        tp=tp,
        pp=_script_flag(script, "--pipeline-model-parallel-size"),
        vpp=None,
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
        fp8=None,
        use_distributed_optimizer=True,
        recompute_activations=True,
        num_engines=32,
        rollout_tp=2,
    )
    kw.update(overrides)
    return kw


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    return ModelShape.from_pretrained(EXAMPLES / "qwen2.5-7b")


@pytest.mark.parametrize("script", ["qwen2.5-7b/pacs.sh", "qwen2.5-7b/grpo.sh"])
def test_7b_recipe_layout_fits_and_has_four_optimizer_steps(qwen7b, script):
    plan = plan_run(qwen7b, **_recipe(script))
    assert plan.optimizer_steps_per_step == 4
    assert plan.responses_per_step == 8192
    assert plan.dp * plan.tp * plan.pp == 64
    assert plan.responses_per_dp_rank_per_minibatch == 256 * 8 // plan.dp
    assert plan.memory.total_gb < 0.9 * 80 and not plan.warnings
    text = plan.format()
    assert "total memory" in text and "world size 64" in text and "WARNING" not in text


@pytest.mark.parametrize("script", ["qwen2.5-3b/pacs.sh", "qwen2.5-3b/grpo.sh"])
def test_3b_recipe_layout_fits(script):
    plan = plan_run(ModelShape.from_pretrained(EXAMPLES / "qwen2.5-3b"), **_recipe(script))
    assert plan.optimizer_steps_per_step == 4 and plan.memory.total_gb < 0.9 * 80 and not plan.warnings


def test_memory_drops_with_distributed_optimizer_and_recompute(qwen7b):
    base = plan_run(qwen7b, **_recipe(use_distributed_optimizer=False, recompute_activations=False)).memory
    dist = plan_run(qwen7b, **_recipe(recompute_activations=False)).memory
    both = plan_run(qwen7b, **_recipe()).memory
    assert dist.adam_gb == pytest.approx(base.adam_gb / 32) and dist.main_params_gb < base.main_params_gb
    assert dist.grads_gb == base.grads_gb  # Megatron DDP's grad buffer is never sharded
    assert both.activations_gb + both.recompute_gb < dist.activations_gb
    assert base.total_gb > dist.total_gb > both.total_gb


def test_memory_components_follow_the_accounting(qwen7b):
    plan = plan_run(qwen7b, **_recipe(tp=1, sequence_parallel=False, use_distributed_optimizer=False))
    m, n = plan.memory, qwen7b.num_params()
    assert m.params_per_gpu == n
    gib = 1024**3
    assert (m.weights_gb, m.main_params_gb, m.grads_gb, m.adam_gb) == pytest.approx(
        (2 * n / gib, 4 * n / gib, 4 * n / gib, 8 * n / gib)
    )
    sbh = 16384 * qwen7b.hidden_size
    assert m.activations_gb == pytest.approx(2 * sbh * 28 / gib)  # recompute keeps each layer's input
    assert m.recompute_gb == pytest.approx(34 * sbh / gib)
    fp32 = plan_run(qwen7b, **_recipe(tp=1, sequence_parallel=False, bf16=False)).memory
    assert fp32.main_params_gb == 0 and fp32.weights_gb == pytest.approx(2 * m.weights_gb)


def test_pipeline_stages_and_micro_batches(qwen7b):
    plan = plan_run(qwen7b, **_recipe(tp=2, pp=4, max_tokens_per_microbatch=None, micro_batch_size=2))
    first, last = plan.stages
    assert (first.stage, last.stage) == ("first", "last")
    assert first.in_flight_micro_batches == 4 and last.in_flight_micro_batches == 1
    assert last.logits_gb > 0 and first.logits_gb == 0
    assert plan.micro_batches_per_minibatch == 256 * 8 // 8 // 2  # DP 8: 256 responses per rank, 2 per micro-batch
    vpp = plan_run(qwen7b, **_recipe(tp=2, pp=2, vpp=2, max_tokens_per_microbatch=None, micro_batch_size=2))
    assert vpp.stages[0].in_flight_micro_batches == (2 * 1 + 1 * 2 + 1) / 2  # Megatron's interleaved warm-up


def test_memory_over_budget_warns_instead_of_raising(qwen7b):
    kw = _recipe(tp=1, sequence_parallel=False, use_distributed_optimizer=False, recompute_activations=False)
    plan = plan_run(qwen7b, **kw)
    assert plan.memory.total_gb > 80 and plan.warnings
    assert "WARNING" in plan.format()


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        (dict(tp=3, sequence_parallel=True), "--tensor-model-parallel-size"),  # 64 % 3
        (dict(world_size=48, tp=3, sequence_parallel=True, ppo_mini_batch_size=256), "--tensor-model-parallel-size"),
        (dict(tp=8), "--tensor-model-parallel-size"),  # 4 kv heads
        (dict(tp=1, pp=3, world_size=48, sequence_parallel=False), "--pipeline-model-parallel-size"),  # 28 layers
        (dict(tp=2, pp=2, vpp=4), "--virtual-pipeline-model-parallel-size"),  # 28 % 8
        (dict(vpp=2), "--virtual-pipeline-model-parallel-size"),  # PP 1
        (dict(tp=1, sequence_parallel=True), "--sequence-parallel"),
        (dict(global_batch_size=1000), "--ppo-mini-batch-size"),
        (dict(ppo_mini_batch_size=16, global_batch_size=1024), "--ppo-mini-batch-size"),  # DP 32
        (dict(max_tokens_per_microbatch=4096), "--max-tokens-per-microbatch"),  # one sequence is 4608
        (dict(fp8="e4m3", bf16=False), "--fp8-format"),
        (dict(fp8="e5m2"), "--fp8-format"),
        (dict(micro_batch_size=0), "--micro-batch-size"),
        (dict(rollout_tp=3), "--rollout-tensor-parallel-size"),
        (dict(tp=2, pp=4, vpp=7, max_tokens_per_microbatch=None, micro_batch_size=256), "--micro-batch-size"),
    ],
)
def test_invalid_configurations_name_their_flag(qwen7b, overrides, flag):
    with pytest.raises(ValueError, match=re.escape(flag)) as e:
        plan_run(qwen7b, **_recipe(**overrides))
    assert ";" in str(e.value)  # "<flag>: <problem>; <fix>"


def test_vocab_not_divisible_by_tp_is_named():
    shape = ModelShape.from_hf_config(dict(TINY, model_type="qwen2", num_attention_heads=8, num_key_value_heads=8))
    with pytest.raises(ValueError, match="vocab_size=300"):
        plan_run(shape, **_recipe(tp=8, world_size=64, num_engines=1, rollout_tp=1))


def test_estimate_is_pure_arithmetic():
    tree = ast.parse(Path(estimate.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "megatron", "ray", "vllm")}
