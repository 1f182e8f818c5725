#!/usr/bin/env bash
# PPO baseline of PACS v2 on Qwen3-8B (arXiv 2509.02522v2, Appendix C: the baselines train with PACS v2's data,
# batches, lengths and learning rates, the KL loss off; the critic at 1e-5 as in v1): GAE over a learned critic,
# 1,024 prompts x 8 responses of up to 8,192 tokens per step, mini-batches of 256 prompts, 320 steps, on 8 nodes x 8
# GPUs beside a separate rollout cluster (RAY_ADDRESS). See docs/reproduction.md and docs/algorithm.md §6.5.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen3-8B \
#       bash examples/qwen3-8b/ppo.sh
#   DRY_RUN=1 bash examples/qwen3-8b/ppo.sh                 # check the layout, print the memory estimate (CPU)
set -euo pipefail

HF_MODEL_DEFAULT=/models/Qwen3-8B
EXP_NAME_DEFAULT="qwen3-8b-ppo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs, the critic a second model on the same layout (DRY_RUN=1 prints
    # the estimate, the critic's weights, gradients and optimizer state included).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # v2's lengths and schedule (later flags override the shared recipe's); 3 full-length sequences per micro-batch.
    --max-response-length 8192 --train-iters 320 --max-tokens-per-microbatch 32768
    # Loss: PPO clipped surrogate (0.2) on GAE advantages, no KL; the actor's clip as grpo.sh.
    --loss ppo --clip-ratio 0.2 --kl-coef 0.0 --clip-grad 0.125
    # Critic: the actor's checkpoint with a new one-output head; the released run's settings (qwen2.5-7b/ppo.sh).
    --critic-lr 1e-5 --critic-weight-decay 0.01 --critic-clip-grad 1.0
    --gae-gamma 1.0 --gae-lambda 1.0 --value-clip 0.5 --critic-warmup 0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
