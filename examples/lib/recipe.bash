# Shared by the multi-node launch scripts in examples/ (sourced, not run). A script sets MODEL_ARGS (layout, loss,
# optimizer), HF_MODEL_DEFAULT and EXP_NAME_DEFAULT, then sources this file and calls `launch`.
#
# Environment (change for your machines; every variable has a default):
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE   the torchrun rendezvous (NODE_RANK differs per node)
#   RAY_ADDRESS, NUM_ENGINES     the rollout fleet's separate Ray cluster and its vLLM engines (TP 2 each)
#   HF_MODEL                     a local HF checkpoint directory (weights, config, tokenizer)
#   TRAIN_DATA, VAL_DATA         files from tools/prepare_data.py; VAL_DATA is a space-separated list ("" = none)
#   EXP_NAME, SAVE_DIR, LOG_DIR, WANDB_PROJECT (optional), PYTHON
#   DRY_RUN=1                    validate layout, batch arithmetic and per-GPU memory on this machine and exit

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"  # examples/lib/../..: whichever script sources this

NNODES="${NNODES:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RAY_ADDRESS="${RAY_ADDRESS:-auto}"  # e.g. ray://rollout-head:10001
NUM_ENGINES="${NUM_ENGINES:-32}"    # vLLM engines x rollout TP 2 = the fleet's GPUs (32 x 2 = 8 nodes x 8 GPUs)
PYTHON="${PYTHON:-python}"

HF_MODEL="${HF_MODEL:-$HF_MODEL_DEFAULT}"
TRAIN_DATA="${TRAIN_DATA:-data/deepscaler.jsonl}"
VAL_DATA="${VAL_DATA-data/math500.jsonl data/aime2024.jsonl data/aime2025.jsonl data/amc23.jsonl}"
EXP_NAME="${EXP_NAME:-$EXP_NAME_DEFAULT}"
SAVE_DIR="${SAVE_DIR:-runs/$EXP_NAME/checkpoints}"
LOG_DIR="${LOG_DIR:-runs/$EXP_NAME/logs}"
WANDB_PROJECT="${WANDB_PROJECT:-}"
DRY_RUN="${DRY_RUN:-0}"

if [[ "$DRY_RUN" == 1 && ! -e "$HF_MODEL" ]]; then
    echo "HF_MODEL=$HF_MODEL does not exist: the dry run reads the shipped $SCRIPT_DIR/config.json" >&2
    HF_MODEL="$SCRIPT_DIR"
fi
read -r -a VAL_FILES <<<"$VAL_DATA"

# The reference recipe's data, batches, lengths, rollouts and schedule (docs/algorithm.md §10.1), common to PACS and GRPO.
RECIPE_ARGS=(
    --hf-model "$HF_MODEL"
    --bf16 --recompute-activations --use-distributed-optimizer
    # Batch: 1024 prompts x 8 responses per step; mini-batches of 256 prompts -> 4 optimizer steps per step.
    --global-batch-size 1024 --group-size 8 --ppo-mini-batch-size 256 --ppo-epochs 1
    --max-prompt-length 512 --max-response-length 4096
    --max-tokens-per-microbatch 16384  # packed micro-batches: >= 3 full-length sequences each
    # Optimizer: AdamW, constant lr, no warm-up (clipping is set per loss by the script).
    --lr 1e-6 --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.999
    # Rollouts on the separate Ray cluster: vLLM engines of TP 2, sampling at T=1, top-p 1.
    --ray-address "$RAY_ADDRESS" --num-engines "$NUM_ENGINES" --rollout-tensor-parallel-size 2
    --temperature 1.0 --top-p 1.0
    # Data, schedule, checkpoints (a restart resumes from the latest complete checkpoint in SAVE_DIR); on SIGTERM
    # (a preempted Slurm job) every rank finishes the step, saves it and exits 0.
    --train-data "$TRAIN_DATA"
    --train-iters 300 --eval-interval 5 --save-interval 20 --seed 1
    --save "$SAVE_DIR" --load "$SAVE_DIR" --log-dir "$LOG_DIR"
    --exit-signal-handler
    # The other ranks wait in a collective while rank 0 starts the fleet and generates a step's rollouts, which at
    # this scale can take longer than Megatron-LM's 10-minute default; a lost node is noticed at once when its
    # connections close, and by the heartbeats (--heartbeat-timeout-seconds, 60 s) when it vanishes without closing
    # them; this timeout is left for a rank that hangs while its heartbeat still beats.
    --distributed-timeout-minutes 60
)
if ((${#VAL_FILES[@]})); then
    RECIPE_ARGS+=(--val-data "${VAL_FILES[@]}")
fi
if [[ -n "$WANDB_PROJECT" ]]; then
    RECIPE_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "$EXP_NAME")
fi

# launch FLAGS...: torchrun on this node, or with DRY_RUN=1 the planner for the full world size on this machine.
launch() {
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "$DRY_RUN" == 1 ]]; then
        exec "$PYTHON" -m megatron_pacs.train "$@" --dry-run --world-size $((NNODES * GPUS_PER_NODE))
    fi
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's TP/SP communication overlap relies on in-order kernel launches
    export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"  # the rollout cluster's token authentication (lib/ray_cluster.sh)
    # torchrun passes SIGTERM on to the ranks, then SIGKILLs them after this long: leave --exit-signal-handler's
    # grace period (60 s) room to finish the step and save.
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-90}"
    exec "$PYTHON" -m megatron_pacs.torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m megatron_pacs.train "$@"
}
