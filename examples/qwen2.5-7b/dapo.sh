#!/usr/bin/env bash
# DAPO on Qwen2.5-7B (arXiv 2503.14476; the settings of verl's recipe/dapo 7B math script): clip-higher 0.2 / 0.28
# with dual clip 10, token-mean aggregation, dynamic sampling (zero-variance groups dropped and refilled), the
# overlong penalty over the last 4,096 of 8,192 response tokens, no KL, 16 responses per prompt, 512 prompts per
# step in mini-batches of 32. On 8 nodes x 8 GPUs; run the same command on every training node with its NODE_RANK;
# the rollouts run on a separate Ray cluster (RAY_ADDRESS). See docs/cluster.md for the fleet, the data and resuming.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen2.5-7B \
#       bash examples/qwen2.5-7b/dapo.sh
#   DRY_RUN=1 bash examples/qwen2.5-7b/dapo.sh             # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
HF_MODEL_DEFAULT=/models/Qwen2.5-7B
EXP_NAME_DEFAULT="qwen2.5-7b-dapo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs (DRY_RUN=1 prints the memory estimate).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # DAPO's batch: 512 prompts x 16 responses per step, 16 optimizer steps of 32 prompts, 8k responses.
    --global-batch-size 512 --group-size 16 --ppo-mini-batch-size 32
    --max-prompt-length 2048 --max-response-length 8192 --max-tokens-per-microbatch 32768
    --lr 1e-6 --lr-warmup-steps 10 --weight-decay 0.1 --clip-grad 1.0
    # Loss: PPO's clipped surrogate with clip-higher and dual clip, verl's token-mean over the mini-batch (the
    # aggregation is verl's own scale, so verl's gradient clip of 1.0 applies as is), group-normalised advantages.
    --loss grpo --advantage-estimator grpo --clip-ratio-low 0.2 --clip-ratio-high 0.28 --clip-ratio-c 10.0
    --loss-agg-mode token-mean --kl-coef 0.0
    # Dynamic sampling and the soft overlong punishment (reward - up to 1.0 over the last 4,096 tokens).
    --filter-groups zero-variance
    --overlong-buffer-len 4096 --overlong-penalty-factor 1.0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
