#!/usr/bin/env bash
# The tiny CPU experiment: one process, no GPU, no downloads. A tiny Qwen2-shaped model and tokenizer are built
# locally and trained with PACS end to end (rollouts, math rewards, Megatron-Core training) by
# megatron_pacs.demo; `make demo` runs the same thing. Extra arguments are passed to the demo.
#
#   bash examples/tiny_cpu.sh
#   PYTHON=.venv/bin/python bash examples/tiny_cpu.sh
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megatron_pacs.demo "$@"
