"""FP8 through the RL step (GPU with Transformer Engine only; skipped elsewhere with the reason).

Every path that runs in bf16 must run in FP8: the old and phase-1 log-probs, the two-phase PACS surrogate, PACS
direct, GRPO, padded and packed micro-batches (the token dimension aligned to 16), for each recipe the GPU
supports (delayed, tensorwise, blockwise; MXFP8 is refused before Blackwell), with the reference policy (KL, the v2
anchor) and with the outer layers in bf16. The consistency check separates
FP8's own gap from a sync error (docs/algorithm.md §7.1-7.2). The CPU half of this (alignment, masking, the
separation) is in tests/mcore/test_forward.py and tests/test_update.py.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a half-installed TE raises all sorts of errors
        return False
    return True


requires_te = pytest.mark.skipif(
    not (torch.cuda.is_available() and _te()), reason="needs CUDA and Transformer Engine (FP8 GEMMs)"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
    from megatron_pacs.mcore.parallel import init_parallel

    path = tmp_path_factory.mktemp("fp8") / "model"
    # every GEMM dimension a multiple of 16 (FP8's requirement)
    build_tiny_model(
        str(path),
        tiny_hf_config("qwen2", hidden=256, heads=8, kv_heads=2, layers=4, vocab_size=1024),
        seed=0,
        scale=3.0,
    )
    return path, init_parallel(ParallelConfig())


def _batch(vocab: int):
    from megatron_pacs.data.batching import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    lens = [
        (int(p), int(r))
        for p, r in zip(
            torch.randint(8, 40, (8,), generator=gen).repeat_interleave(4),
            torch.randint(4, 90, (32,), generator=gen),
            strict=True,
        )
    ]
    seqs = [torch.randint(3, vocab, (p + r,), generator=gen).tolist() for p, r in lens]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 8)
    return RolloutBatch.from_sequences(
        seqs, torch.tensor([p for p, _ in lens]), torch.tensor([r for _, r in lens]), rewards, 4
    )


def _supported(recipe: str) -> str | None:
    """None if this GPU runs the recipe, else why not."""
    major, minor = torch.cuda.get_device_capability()
    if recipe == "mxfp8" and major < 10:
        return "MXFP8 needs Blackwell"
    if recipe == "blockwise" and (major, minor) < (9, 0):
        return "blockwise scaling needs Hopper"
    return None


def _model(path, **overrides):
    """An FP8 (hybrid) TE model of the fixture's weights; ``overrides`` are ModelConfig fields."""
    from megatron_pacs.config import ModelConfig

    settings = dict(hf_model=str(path), bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise", transformer_impl="te")
    return ModelConfig(**{**settings, **overrides})


def _cfg(**overrides):
    """Two mini-batches of 4 prompts x 4 responses (``overrides`` are BatchConfig fields)."""
    from megatron_pacs.config import BatchConfig

    settings = dict(
        global_batch_size=8,
        group_size=4,
        ppo_mini_batch_size=4,
        micro_batch_size=4,
        max_prompt_length=40,
        max_response_length=90,
    )
    return BatchConfig(**{**settings, **overrides})


@requires_te
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize(("loss", "scores"), [("pacs", "bf16"), ("pacs", "fp8"), ("grpo", "bf16")])
def test_gpu_fp8_rl_step_runs_every_path(setup, recipe, packing, loss, scores):
    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.config import LossConfig, OptimConfig
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.update import step_layout, update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    if (why := _supported(recipe)) is not None:
        pytest.skip(why)
    path, groups = setup
    actor = Actor(_model(path, fp8_recipe=recipe, fp8_score_precision=scores), groups, OptimConfig(lr=1e-5))
    align = 32 if recipe == "mxfp8" else 16  # MXFP8 scales blocks of 32 (megatron-core's get_fp8_align_size)
    assert actor.fp8 and actor.token_alignment == align
    batch = _batch(1024)
    cfg = _cfg(sequence_packing=packing)
    objective = build_objective(LossConfig(loss=loss), cfg)
    # the step's own layout: its consistency check compares with a bf16 pass over the first mini-batch's
    # micro-batches, and a stand-in packed differently would differ by bf16 rounding of other GEMM shapes
    layout = step_layout(batch, cfg, groups, whole_groups=objective.whole_groups, align=actor.token_alignment)
    assert all(mb.tokens.shape[1] % align == 0 for mb in layout.micro_batches([0, 1]))
    # The engines' log-probs stand-in: a bf16 pass of the same weights (a correct sync), at temperature 1, over
    # the same micro-batches as the step's own bf16 pass, mini-batch by mini-batch.
    engine = torch.full((int(batch.response_lens.sum()),), float("nan"))
    offsets = batch.engine_offsets
    for k in range(layout.num_mini_batches):
        ref = actor.logprobs(layout.micro_batches([k]), batch.response_lens, tokens=True, fp8=False).tokens
        assert ref is not None
        for i in layout.rows([k]):
            engine[offsets[i] : offsets[i + 1]] = ref.response(i).cpu()
    assert not engine.isnan().any()
    batch.engine_logprobs = engine
    metrics = update_policy(
        actor, batch, objective, cfg, groups, PhaseTimer(), temperature=1.0, score_fp8=scores == "fp8"
    )
    assert metrics["train/optimizer_steps"] == 2.0 and math.isfinite(metrics["train/grad_norm"])
    assert math.isfinite(metrics["train/loss"])
    assert metrics["consistency/logprob_abs_diff_max"] < 1e-3  # engines vs the bf16 pass: in sync
    assert metrics["consistency/fp8_gap_logprob_abs_diff_mean"] > 0.0  # FP8's own gap, reported apart


@requires_te
def test_gpu_fp8_direct_pacs_with_fp8_scores(setup):
    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.config import LossConfig, OptimConfig
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.update import update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    path, groups = setup
    actor = Actor(_model(path, fp8_score_precision="fp8"), groups, OptimConfig(lr=1e-5))
    cfg = _cfg(keep_groups_in_microbatch=True)
    metrics = update_policy(
        actor,
        _batch(1024),
        build_objective(LossConfig(), cfg),
        cfg,
        groups,
        PhaseTimer(),
        temperature=1.0,
        score_fp8=True,
    )
    assert math.isfinite(metrics["train/grad_norm"]) and math.isfinite(metrics["pacs/loss"])


@requires_te
@pytest.mark.parametrize("first_last_bf16", [False, True], ids=["all_fp8", "first_last_bf16"])
@pytest.mark.parametrize("objective", ["grpo_kl", "pacs_v2_kl"])
def test_gpu_fp8_with_the_reference_policy(setup, objective, first_last_bf16):
    """The reference's log-probs (with the actor's old ones in the same forward-only schedule for GRPO), a KL term
    and PACS v2's reference anchor under FP8, score passes in bf16; optionally the outer layers kept in bf16."""
    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.config import LossConfig, OptimConfig
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.reference import ReferencePolicy
    from megatron_pacs.update import update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    path, groups = setup
    model = _model(path, first_last_layers_bf16=first_last_bf16)
    actor = Actor(model, groups, OptimConfig(lr=1e-5))
    reference = ReferencePolicy(model, groups, load=None, offload=False)
    cfg = _cfg()
    loss = (
        LossConfig(loss="grpo", kl_coef=0.1)
        if objective == "grpo_kl"
        else LossConfig(pacs_score_reference="ref", kl_coef=0.1)
    )
    metrics = update_policy(
        actor,
        _batch(1024),
        build_objective(loss, cfg),
        cfg,
        groups,
        PhaseTimer(),
        temperature=1.0,
        reference=reference,
    )
    assert metrics["train/optimizer_steps"] == 2.0 and math.isfinite(metrics["train/grad_norm"])
    # theta = theta_ref, but the KL term compares the FP8 training pass with the bf16 reference pass: FP8's gap
    assert math.isfinite(metrics["ref/kl"]) and metrics["ref/kl"] >= 0.0
    assert math.isfinite(metrics["train/loss"])


@requires_te
def test_gpu_mxfp8_is_refused_before_blackwell(tmp_path):
    from megatron_pacs.config import parse_config

    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("a Blackwell GPU runs MXFP8")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    cfg = parse_config(
        [
            "--hf-model",
            str(tmp_path),
            "--train-data",
            str(tmp_path / "train.jsonl"),
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "mxfp8",
        ]
    )
    with pytest.raises(ValueError, match="--fp8-recipe: mxfp8 needs a Blackwell GPU"):
        cfg.validate(1)
