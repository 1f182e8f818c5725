#!/usr/bin/env bash
# GRPO baseline on Qwen2.5-7B: the PACS paper's baseline (PACS repo scripts/baseline/, stock verl GRPO) with the
# data, batches, lengths and schedule of pacs.sh beside it, on 8 nodes x 8 GPUs. Run the same command on every
# training node with its NODE_RANK; the rollouts run on a separate Ray cluster (RAY_ADDRESS). See
# examples/README.md for the fleet, the data and resuming.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen2.5-7B \
#       bash examples/qwen2.5-7b/grpo.sh
#   DRY_RUN=1 bash examples/qwen2.5-7b/grpo.sh             # check the layout, print the memory estimate (CPU)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

# Cluster: change for your machines. NODE_RANK differs per node; MASTER_ADDR is node 0's address.
NNODES="${NNODES:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RAY_ADDRESS="${RAY_ADDRESS:-auto}"  # the rollout fleet's Ray cluster, e.g. ray://rollout-head:10001
NUM_ENGINES="${NUM_ENGINES:-32}"    # vLLM engines x rollout TP 2 = the fleet's GPUs (32 x 2 = 8 nodes x 8 GPUs)
PYTHON="${PYTHON:-python}"

# Paths: HF_MODEL is a local HF checkpoint directory (weights, config, tokenizer); the data comes from
# tools/prepare_data.py. VAL_DATA is a space-separated list (set it empty for no validation).
HF_MODEL="${HF_MODEL:-/models/Qwen2.5-7B}"
TRAIN_DATA="${TRAIN_DATA:-data/deepscaler.jsonl}"
VAL_DATA="${VAL_DATA-data/math500.jsonl data/aime2024.jsonl data/aime2025.jsonl data/amc23.jsonl}"
EXP_NAME="${EXP_NAME:-qwen2.5-7b-grpo}"
SAVE_DIR="${SAVE_DIR:-runs/$EXP_NAME/checkpoints}"
LOG_DIR="${LOG_DIR:-runs/$EXP_NAME/logs}"
WANDB_PROJECT="${WANDB_PROJECT:-}"  # optional: set to log to Weights & Biases

DRY_RUN="${DRY_RUN:-0}"
if [[ "$DRY_RUN" == 1 && ! -e "$HF_MODEL" ]]; then
    echo "HF_MODEL=$HF_MODEL does not exist: the dry run reads the shipped $SCRIPT_DIR/config.json" >&2
    HF_MODEL="$SCRIPT_DIR"
fi
read -r -a VAL_FILES <<<"$VAL_DATA"

ARGS=(
    --hf-model "$HF_MODEL"
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs; the estimate is ~32 GiB per GPU (DRY_RUN=1 prints it).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --bf16 --recompute-activations --use-distributed-optimizer
    # Batch: 1024 prompts x 8 responses per step; mini-batches of 256 prompts -> 4 optimizer steps per step.
    --global-batch-size 1024 --group-size 8 --ppo-mini-batch-size 256 --ppo-epochs 1
    --max-prompt-length 512 --max-response-length 4096
    --max-tokens-per-microbatch 16384  # packed micro-batches: >= 3 full-length sequences each
    # Loss: GRPO, group-normalised outcome advantage, PPO clipped surrogate (0.2), no KL.
    --loss grpo --clip-ratio 0.2 --kl-coef 0.0
    # Optimizer: AdamW, constant lr, no warm-up. Unlike the PACS path, stock verl GRPO applies its grad_clip 1.0.
    --lr 1e-6 --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0
    # Rollouts on the separate Ray cluster: vLLM engines of TP 2, sampling at T=1, top-p 1.
    --ray-address "$RAY_ADDRESS" --num-engines "$NUM_ENGINES" --rollout-tensor-parallel-size 2
    --temperature 1.0 --top-p 1.0
    # Data, schedule, checkpoints (a restart resumes from the latest complete checkpoint in SAVE_DIR).
    --train-data "$TRAIN_DATA"
    --train-iters 300 --eval-interval 5 --save-interval 20 --seed 1
    --save "$SAVE_DIR" --load "$SAVE_DIR" --log-dir "$LOG_DIR"
)
if ((${#VAL_FILES[@]})); then
    ARGS+=(--val-data "${VAL_FILES[@]}")
fi
if [[ -n "$WANDB_PROJECT" ]]; then
    ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "$EXP_NAME")
fi

export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$DRY_RUN" == 1 ]]; then
    exec "$PYTHON" -m megatron_pacs.train "${ARGS[@]}" --dry-run --world-size $((NNODES * GPUS_PER_NODE))
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's TP/SP communication overlap relies on in-order kernel launches
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m megatron_pacs.train "${ARGS[@]}"
