#!/usr/bin/env bash
# GRPO baseline of PACS v2 on Qwen3-4B (arXiv 2509.02522v2, Appendix C: the baselines train with PACS v2's data,
# batches, lengths and learning rate, the KL loss off): 1,024 prompts x 8 responses of up to 8,192 tokens per step,
# mini-batches of 256 prompts, lr 1e-6, 120 steps, on 8 nodes x 8 GPUs beside a separate rollout cluster
# (RAY_ADDRESS). See docs/reproduction.md for the table it reproduces and the evaluation protocol.
#
#   NODE_RANK=0 MASTER_ADDR=train-node0 RAY_ADDRESS=ray://rollout-head:10001 HF_MODEL=/models/Qwen3-4B \
#       bash examples/qwen3-4b/grpo.sh
#   DRY_RUN=1 bash examples/qwen3-4b/grpo.sh                # check the layout, print the memory estimate (CPU)
set -euo pipefail

HF_MODEL_DEFAULT=/models/Qwen3-4B
EXP_NAME_DEFAULT="qwen3-4b-grpo"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.bash"

MODEL_ARGS=(
    # Layout: TP 2 x PP 1 x DP 32 on 64 80 GB GPUs, as pacs_v2.sh (DRY_RUN=1 prints the per-GPU estimate).
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    # v2's lengths and schedule (later flags override the shared recipe's); 3 full-length sequences per micro-batch.
    --max-response-length 8192 --train-iters 120 --max-tokens-per-microbatch 32768
    # Loss: GRPO, group-normalised outcome advantage, PPO clipped surrogate (0.2), no KL; verl's clip of 1.0 on a
    # loss 8x ours is 1 / 8 here (docs/algorithm.md §6), as examples/qwen2.5-7b/grpo.sh.
    --loss grpo --clip-ratio 0.2 --kl-coef 0.0 --clip-grad 0.125
)
launch "${RECIPE_ARGS[@]}" "${MODEL_ARGS[@]}"
