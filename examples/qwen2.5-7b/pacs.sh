#!/usr/bin/env bash
# PACS on Qwen2.5-7B: the reference recipe (arXiv 2509.02522; PACS repo scripts/pacs/pacs_beta_1.0.sh) on
# 8 nodes x 8 GPUs. Run the same command on every training node with its NODE_RANK; the rollouts run on a
# separate Ray cluster (RAY_ADDRESS). See docs/cluster.md for the fleet, the data and resuming.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen2.5-7B \
#       bash examples/qwen2.5-7b/pacs.sh
#   PACS_BETA=2.0 ... bash examples/qwen2.5-7b/pacs.sh     # the beta = 2.0 run (pacs_beta_2.0.sh)
#   DRY_RUN=1 bash examples/qwen2.5-7b/pacs.sh             # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
PACS_BETA="${PACS_BETA:-1.0}"
HF_MODEL_DEFAULT=/models/Qwen2.5-7B
EXP_NAME_DEFAULT="qwen2.5-7b-pacs-beta$PACS_BETA"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs; the estimate is ~32 GiB per GPU (DRY_RUN=1 prints it).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # Loss: PACS with the reference options (log-ratio score, RLOO logit, class-balanced weights).
    --loss pacs --pacs-beta "$PACS_BETA" --pacs-score log_ratio --pacs-advantage rloo --pacs-weights balanced
    # The reference does not clip gradients on the PACS path (grad_clip 1.0 is configured but never applied).
    --clip-grad 0.0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
