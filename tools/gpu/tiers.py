"""The tiers of ``make gpu-check`` (tools/gpu/check.py): their budgets, each step's time limit, the plans of the rollout
and TE tiers (their steps in order, most telling first) and the flags of the runs. Data only (no torch), so the
suite checks every plan against its budget without a GPU (tests/tools/test_gpu_tiers.py).
"""

from __future__ import annotations

from typing import Any

# Qwen2.5-0.5B's shape (random init; the vocabulary is the local tokenizer's).
E2E_SHAPE: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# Three PACS steps without the fleet: the reference policy, reset at step 2, and a KL term (trainer tier).
SYNTHETIC_FLAGS = [
    *("--rollout-source", "synthetic", "--train-iters", "3", "--global-batch-size", "8", "--group-size", "8"),
    *("--ppo-mini-batch-size", "4", "--max-prompt-length", "256", "--max-response-length", "1024", "--bf16"),
    *("--pacs-score-reference", "ref", "--ref-reset-interval", "2", "--kl-coef", "0.01"),
    # resume == continuous is checked bit for bit: attention's default backward on CUDA sums with atomics
    "--deterministic-mode",
]
# PPO beside GRPO (trainer tier, after the rest): three synthetic steps each on the same shape and rollouts, the
# critic trained alone at step 1; their step times and GPU memory compare what the critic costs (issue 51).
_PACS_ONLY = ("--pacs-score-reference", "ref", "--ref-reset-interval", "2", "--kl-coef", "0.01")
_BASE_SYNTHETIC = [f for f in SYNTHETIC_FLAGS if f not in _PACS_ONLY]
CRITIC_COMPARISON = {
    "rl_synthetic_grpo": [*_BASE_SYNTHETIC, "--loss", "grpo"],
    "rl_synthetic_ppo": [*_BASE_SYNTHETIC, "--loss", "ppo", "--critic-warmup", "1"],
}
# Three PACS steps with a vLLM CUDA engine (full and rollout tiers).
E2E_FLAGS = [
    *("--train-iters", "3", "--global-batch-size", "8", "--ppo-mini-batch-size", "4", "--group-size", "4"),
    *("--max-prompt-length", "128", "--max-response-length", "128", "--bf16", "--rollout-dtype", "bfloat16"),
    *("--reward-workers", "2"),
]
COLOCATED_FLAGS = ["--colocate", "--weight-sync", "ipc", "--offload-optimizer-during-rollout"]
# The rollout tier's asynchronous run (rl_async) on one GPU: the engine (a Ray actor of one GPU) beside the trainer
# on GPU 0, not colocated (colocated engines sleep while the actor trains, so no stream could generate then). NCCL
# cannot join two ranks on one GPU, so the weights go through Ray's object store; vLLM checks the free memory at its
# start, so it takes 35% of the GPU and leaves the trainer the rest.
SHARED_GPU_FLAGS = ["--weight-sync", "object_store", "--gpu-memory-utilization", "0.35"]
# Two weight updates stale at most, responses continuing across updates in rounds of 32 tokens (of 128).
ASYNC_FLAGS = ["--max-staleness", "2", "--partial-rollouts", "--rollout-round-tokens", "32"]
# TE tier: an FP8 trainer (TE's tensorwise recipe, hybrid format) whose score passes run in bf16.
FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
FP8_RL_FLAGS = [*(f for f in SYNTHETIC_FLAGS if f != "--deterministic-mode"), *FP8_FLAGS]
FP8_RL_FLAGS += ["--fp8-score-precision", "bf16", "--transformer-impl", "te"]
# The 1.5B step's size on one GPU: 4 prompts x 8 responses, one padded row (or its worst-case tokens packed) per
# micro-batch. The first H100 run of the default (8 prompts, 2 rows) failed in every variant, its exception hidden
# by NCCL's exit warning; the same bench at 4 prompts ran fwd+bwd within 49 GiB, and the train variant adds ~27 GiB
# of optimizer state on one GPU.
TRAIN_STEP_SIZE = ["--prompts", "4", "--micro-batch-size", "1", "--warmup", "1", "--iters", "3"]
# FP8 drift (TE tier): the recipe the FP8 run trains with, FP8 everywhere (A) and FP8 training + bf16 scores (B)
# against bf16, 4 responses of 4,096 tokens (errors over the first 1k and all 4k tokens).
DRIFT_ARGS = ["--recipes", "tensorwise", "--options", "bf16", "A", "B", "--sequences", "4", "--length", "4096"]
R3_TEST = "tests/mcore/test_router_replay.py::test_vllm_routed_experts_replayed_by_the_trainer"

# Each step's time limit (seconds) on one H100, from the README's H100 baseline (shared/gpu figures: a 1.5B
# fwd+bwd 0.17-0.28 s, a full train step 0.25-0.38 s, a 7B fwd+bwd 0.31-0.42 s, a PACS step through the project
# 1.8 s, the 1.5B weight export 0.26 s) plus what the baseline does not count: a process's start (CUDA context,
# imports of torch, megatron-core and transformers: about 20 s), building a random model on the GPU (1.5B: about
# 15 s; 7B: about 60 s) and the HF reference's load. The limit is about 2x that estimate.
LIMITS = {
    # pytest start (~20 s) and one CUDA process per distributed test (~20 s each, ~5 of them without TE/vLLM)
    "gpu_tests": 240,
    # 4 implementations x 13 timed passes of <= 20 ms, one process: start-up bound (~30 s)
    "bench_logprobs": 90,
    # 3 variants x 2 layouts in one process each (~20 s start + 15 s model + (1 + 3) x 0.4 s): ~6 x 37 s = 220 s
    "train_step_1.5b": 420,
    # (full tier) the TE train step: 2 layouts x (20 s + 15 s + 6 x 0.3 s)
    "train_step_1.5b_te": 180,
    # a 0.5B model built once (~30 s); a 3-step synthetic run: start 30 s, 3 x (0.6 s step + 3 s checkpoint)
    "rl_setup": 120,
    "rl_synthetic": 180,
    "rl_synthetic_resumed": 120,
    # (trainer) 3 synthetic steps each, GRPO then PPO (a second 0.5B model, its values pass and update): ~30 s start
    "rl_synthetic_grpo": 120,
    "rl_synthetic_ppo": 150,
    # (full, rollout) an end-to-end run with a vLLM CUDA engine: engine start (~60-90 s: compile, CUDA graphs) +
    # the trainer's start (~30 s) + 3 steps (~10 s each with sleep/wake and the sync)
    "rl_e2e": 300,
    # (rollout) the same, asynchronous (two updates stale, partial rollouts) with the engine beside the trainer:
    # no sleep/wake, an object-store sync (~1 GB of bf16 weights) per step
    "rl_async": 240,
    # (rollout) pytest's start (~20 s), a tiny Qwen3-MoE engine (~60 s) and the trainer's replay (~30 s)
    "r3_routed_experts": 180,
    # (full tier) the 7B model on the GPU (~60 s), 3 FP8 recipes + bf16 x (1 + 3) x 0.4 s, per process ~90 s
    "train_step_7b_fp8": 480,
    "bench_fp8_drift": 240,
    "diag_te_fp32": 90,
    # (te) the packed train step with TE in bf16 and FP8: 2 processes x (20 s + 15 s + 4 x 0.4 s + TE's set-up)
    "train_step_1.5b_te_fp8": 180,
    # (te) the packed train step without TE, one process
    "train_step_1.5b_no_te_packed": 100,
    # (te) 3 synthetic PACS steps with an FP8 trainer and bf16 score passes: start 30 s, 0.5B build, 3 x ~2 s
    "rl_fp8_synthetic": 150,
    # (te) 1.5B anchor (10 training steps), fp32 reference, bf16, A and B over 4 x 4,096 tokens
    "fp8_drift": 200,
}
TIER_BUDGET_MIN = {"trainer": 6.5, "full": 25.0, "rollout": 6.5, "te": 6.5}

# The rollout and TE tiers, most telling first; a step the remaining budget no longer fits (MIN_START_S) is
# skipped with that reason, and so is every later one that does not fit either.
PLANS = {
    "rollout": ("rl_setup", "rl_colocated", "rl_async", "r3_routed_experts"),
    "te": ("train_step_1.5b_te_fp8", "rl_setup", "rl_fp8_synthetic", "train_step_1.5b_no_te_packed", "fp8_drift"),
}
# The least time worth starting a step with (seconds): about the H100 estimate of what it needs to finish.
MIN_START_S = {
    "rl_setup": 30,
    "rl_colocated": 150,
    "rl_async": 150,
    "r3_routed_experts": 100,
    "train_step_1.5b_te_fp8": 80,
    "rl_fp8_synthetic": 70,
    "train_step_1.5b_no_te_packed": 45,
    "fp8_drift": 120,
}


def step_limit(name: str) -> int:
    """A step's time limit in seconds (the end-to-end runs share ``rl_e2e``'s)."""
    return LIMITS.get(name, LIMITS["rl_e2e"])
