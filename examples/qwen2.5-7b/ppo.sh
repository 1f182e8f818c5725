#!/usr/bin/env bash
# PPO baseline on Qwen2.5-7B: the PACS paper's other baseline (PACS repo scripts/baseline/ppo.sh and
# configs/ppo_trainer.yaml on its verl), GAE over a learned critic, with the data, batches, lengths and schedule of
# pacs.sh beside it, on 8 nodes x 8 GPUs. Run the same command on every training node with its NODE_RANK; the
# rollouts run on a separate Ray cluster (RAY_ADDRESS). See docs/cluster.md for the fleet, the data and resuming,
# docs/algorithm.md §6.5 for PPO.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen2.5-7B \
#       bash examples/qwen2.5-7b/ppo.sh
#   DRY_RUN=1 bash examples/qwen2.5-7b/ppo.sh              # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
HF_MODEL_DEFAULT=/models/Qwen2.5-7B
EXP_NAME_DEFAULT="qwen2.5-7b-ppo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs, the critic a second model on the same layout (DRY_RUN=1 prints
    # the estimate, the critic's weights, gradients and optimizer state included).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # Loss: PPO clipped surrogate (0.2) on GAE advantages; no KL anywhere, no entropy term (the released run).
    --loss ppo --clip-ratio 0.2 --kl-coef 0.0
    # Actor clip: verl clips at 1.0 a loss 8x ours (docs/algorithm.md §6), as grpo.sh.
    --clip-grad 0.125
    # Critic: the actor's checkpoint with a new one-output head; AdamW 1e-5, weight decay 0.01, clip 1.0 (the
    # released values as they are: whether verl's per-micro-batch factor applies to them as to the actor's depends
    # on the critic's micro-batch, not set here), the actor's constant schedule; GAE gamma = lambda = 1; value clip
    # 0.5; no critic warm-up.
    --critic-lr 1e-5 --critic-weight-decay 0.01 --critic-clip-grad 1.0
    --gae-gamma 1.0 --gae-lambda 1.0 --value-clip 0.5 --critic-warmup 0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
