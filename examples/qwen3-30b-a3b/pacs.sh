#!/usr/bin/env bash
# PACS on Qwen3-30B-A3B (MoE: 128 experts, top-8, 3.3B of 30.5B parameters active per token): the reference recipe
# of examples/lib/recipe.bash (1,024 prompts x 8 responses of up to 4,096 tokens per step, mini-batches of 256
# prompts, lr 1e-6, 300 steps) with PACS's reference options, on 8 nodes x 8 GPUs. Run the same command on every
# training node with its NODE_RANK; the rollouts run on a separate Ray cluster (RAY_ADDRESS). See
# docs/cluster.md for the fleet, the data and resuming, and docs/architecture.md §3.2 for what MoE supports.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen3-30B-A3B \
#       bash examples/qwen3-30b-a3b/pacs.sh
#   DRY_RUN=1 bash examples/qwen3-30b-a3b/pacs.sh          # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
PACS_BETA="${PACS_BETA:-1.0}"
# r3 (rollout routing replay): the trainer routes each token to the experts the engine chose (needs vLLM on CUDA).
ROUTER_REPLAY="${ROUTER_REPLAY:-off}"
HF_MODEL_DEFAULT=/models/Qwen3-30B-A3B
EXP_NAME_DEFAULT="qwen3-30b-a3b-pacs-beta$PACS_BETA"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs, sequence parallel (Megatron's MoE layers need it at TP > 1);
    # experts over EP 8 (16 of 128 per rank; an EP group is one node's 8 consecutive ranks, so the all-to-all token
    # exchange stays on NVLink), whole on both TP ranks. The estimate is ~39 GiB per GPU (DRY_RUN=1 prints it).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall --router-replay "$ROUTER_REPLAY"
    # Loss: PACS with the reference options (log-ratio score, RLOO logit, class-balanced weights).
    --loss pacs --pacs-beta "$PACS_BETA" --pacs-score log_ratio --pacs-advantage rloo --pacs-weights balanced
    # The reference does not clip gradients on the PACS path (grad_clip 1.0 is configured but never applied).
    --clip-grad 0.0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
