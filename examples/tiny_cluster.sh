#!/usr/bin/env bash
# The multi-node deployment of docs/cluster.md at toy scale, on CPUs: 2 training nodes x 1 rank (gloo) and a
# separate Ray rollout cluster with one vLLM engine per rollout node (examples/lib/ray_cluster.sh), the trainer
# reaching it through Ray Client and broadcasting new weights from trainer rank 0 to the engines after every step.
# The test suite runs exactly this on a virtual cluster (tests/cluster/); the tiny model and data come from
# `python -m megatron_pacs.demo --help` or any small HF Qwen2 directory.
#
#   # rollout nodes:  NUM_GPUS=0 bash examples/lib/ray_cluster.sh head   |   ... worker rollout-head:6379
#   # training node i (0, 1):
#   NODE_RANK=$i MASTER_ADDR=train0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=tiny/model \
#       TRAIN_DATA=tiny/train.jsonl SAVE_DIR=/shared/tiny-cluster/ckpt GLOO_SOCKET_IFNAME=eth0 \
#       bash examples/tiny_cluster.sh
#
# Environment: as the other recipes (examples/lib/recipe.bash), with tiny defaults: NNODES=2, GPUS_PER_NODE=1,
# NUM_ENGINES=2, VAL_DATA="" (none); plus TRAIN_ITERS (3) and SAVE_INTERVAL (1). Extra arguments go to the trainer.
# ROLLOUT_SOURCE=synthetic trains on seeded synthetic rollouts instead (no Ray cluster, no engines, no reward pool):
# what the Slurm tests (tests/cluster/test_slurm.py) run.
set -euo pipefail

NNODES="${NNODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-1}"
NUM_ENGINES="${NUM_ENGINES:-2}"
VAL_DATA="${VAL_DATA-}"
TRAIN_ITERS="${TRAIN_ITERS:-3}"
SAVE_INTERVAL="${SAVE_INTERVAL:-1}"
ROLLOUT_SOURCE="${ROLLOUT_SOURCE:-fleet}"
HF_MODEL_DEFAULT=tiny/model
EXP_NAME_DEFAULT=tiny-cluster
source "$(dirname "${BASH_SOURCE[0]}")/lib/recipe.bash"

TINY_ARGS=(
    --hf-model "$HF_MODEL" --train-data "$TRAIN_DATA"
    # 4 prompts x 4 responses per step, 2 optimizer steps, short texts; fp32, so the engines match the trainer.
    --global-batch-size 4 --group-size 4 --ppo-mini-batch-size 2 --micro-batch-size 8
    --max-prompt-length 96 --max-response-length 12 --lr 1e-3
    --train-iters "$TRAIN_ITERS" --save-interval "$SAVE_INTERVAL" --seed 1
    --save "$SAVE_DIR" --load "$SAVE_DIR" --log-dir "$LOG_DIR"
    --exit-signal-handler
)
if [[ "$ROLLOUT_SOURCE" == synthetic ]]; then
    TINY_ARGS+=(--rollout-source synthetic)
else
    # The rollout cluster: one engine per rollout node, new weights broadcast from trainer rank 0 (gloo on CPU).
    TINY_ARGS+=(--reward-workers 1 --ray-address "$RAY_ADDRESS" --num-engines "$NUM_ENGINES" --weight-sync broadcast
        --kv-cache-gb 0.25)
fi
if ((${#VAL_FILES[@]})); then
    TINY_ARGS+=(--val-data "${VAL_FILES[@]}" --eval-interval "$TRAIN_ITERS")
fi
launch "${TINY_ARGS[@]}" "$@"
