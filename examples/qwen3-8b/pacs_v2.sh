#!/usr/bin/env bash
# PACS v2 on Qwen3-8B (arXiv 2509.02522v2, Appendix C): the score anchored at a frozen reference policy that is
# hard-reset to the current policy (with the optimizer state) every REF_RESET_INTERVAL steps; 1,024 prompts x 8
# responses of up to 8,192 tokens per step, mini-batches of 256 prompts (4 updates per step), lr 1e-6, beta 1.0, no
# KL, 320 steps, on 8 nodes x 8 GPUs. Run the same command on every training node with its NODE_RANK; the rollouts
# run on a separate Ray cluster (RAY_ADDRESS). See docs/cluster.md for the fleet, the data, resuming and the
# evaluation protocol (T 0.6, top-p 0.95, unbiased pass@k from n = 128 samples).
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen3-8B \
#       bash examples/qwen3-8b/pacs_v2.sh
#   DRY_RUN=1 bash examples/qwen3-8b/pacs_v2.sh             # check the layout, print the memory estimate (CPU)
set -euo pipefail

# Model and run name; everything else (cluster, paths, the shared recipe, DRY_RUN) is in examples/lib/recipe.bash.
# The reset interval is our choice, not the paper's (docs/algorithm.md §2.2): 20 steps = 80 optimizer steps, long
# enough for the anchor to carry information across many updates (v1 re-anchors every step), short enough to keep
# beta * (l - l_ref) in the sigmoid's responsive range; reset sooner if pacs/logit/max climbs past ~10.
REF_RESET_INTERVAL="${REF_RESET_INTERVAL:-20}"
HF_MODEL_DEFAULT=/models/Qwen3-8B
EXP_NAME_DEFAULT="qwen3-8b-pacs-v2"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs (DRY_RUN=1 prints the per-GPU estimate).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # v2's lengths and schedule (later flags override the shared recipe's); 3 full-length sequences per micro-batch.
    --max-response-length 8192 --train-iters 320 --max-tokens-per-microbatch 32768
    # Loss: PACS anchored at the reference (log-ratio score, RLOO logit, class-balanced weights), beta 1.0, no KL.
    --loss pacs --pacs-beta 1.0 --pacs-score log_ratio --pacs-score-reference ref --pacs-advantage rloo
    --pacs-weights balanced --kl-coef 0.0
    # The reference starts as the initial policy (--hf-model) and is reset with the optimizer (ProRL's reset).
    --ref-reset-interval "$REF_RESET_INTERVAL" --ref-reset-optimizer
    --clip-grad 0.0
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
