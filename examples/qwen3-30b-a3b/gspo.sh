#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B (arXiv 2507.18071, Qwen3's recipe for MoE RL): the clip on each response's geometric-mean
# importance ratio, in its token-level stop-gradient form, with the paper's clip range 3e-4 / 4e-4, per-response
# mean aggregation (seq-mean-token-mean), no KL, each step's batch in four mini-batches; data, batches, lengths and
# schedule of pacs.sh beside it, on 8 nodes x 8 GPUs. GSPO needs no routing replay for stability (its ratio is
# per response), so ROUTER_REPLAY stays off by default. Run the same command on every training node with its
# NODE_RANK; the rollouts run on a separate Ray cluster (RAY_ADDRESS). See docs/cluster.md.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen3-30B-A3B \
#       bash examples/qwen3-30b-a3b/gspo.sh
#   DRY_RUN=1 bash examples/qwen3-30b-a3b/gspo.sh          # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
ROUTER_REPLAY="${ROUTER_REPLAY:-off}"
HF_MODEL_DEFAULT=/models/Qwen3-30B-A3B
EXP_NAME_DEFAULT="qwen3-30b-a3b-gspo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout as pacs.sh: TP 2 (sequence parallel) x PP 1 x DP 32, experts over EP 8 (one node per EP group),
    # all-to-all dispatch (DRY_RUN=1 prints the memory estimate).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall --router-replay "$ROUTER_REPLAY"
    # Loss: GSPO, group-normalised advantages, sequence-level clip 1 - 3e-4 .. 1 + 4e-4, per-response mean.
    --loss gspo --advantage-estimator grpo --clip-ratio-low 3e-4 --clip-ratio-high 4e-4
    --loss-agg-mode seq-mean-token-mean --kl-coef 0.0
    --clip-grad 1.0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
