#!/usr/bin/env bash
# GRPO baseline on Qwen2.5-7B: the PACS paper's baseline (PACS repo scripts/baseline/, stock verl GRPO) with the
# data, batches, lengths and schedule of pacs.sh beside it, on 8 nodes x 8 GPUs. Run the same command on every
# training node with its NODE_RANK; the rollouts run on a separate Ray cluster (RAY_ADDRESS). See
# docs/cluster.md for the fleet, the data and resuming.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen2.5-7B \
#       bash examples/qwen2.5-7b/grpo.sh
#   DRY_RUN=1 bash examples/qwen2.5-7b/grpo.sh             # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
HF_MODEL_DEFAULT=/models/Qwen2.5-7B
EXP_NAME_DEFAULT="qwen2.5-7b-grpo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs; the estimate is ~32 GiB per GPU (DRY_RUN=1 prints it).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # Loss: GRPO, group-normalised outcome advantage, PPO clipped surrogate (0.2), no KL.
    --loss grpo --clip-ratio 0.2 --kl-coef 0.0
    # Stock verl GRPO clips at 1.0 a loss 8x ours (verl's per-GPU micro-batch of 8 responses is not divided out;
    # docs/algorithm.md §6): 1.0 / 8 here is the reference's effective clip.
    --clip-grad 0.125
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
