#!/usr/bin/env python3
"""``make gpu-check``: the GPU check harness (``tools/gpu/``) on a machine with one or more CUDA GPUs.

Usage: python3 tools/gpu_check.py --tier trainer|rollout|te|full [--out gpu-report] [--baseline old/report.json]
       [--budget-min M] [--only STEP ...]

The tiers, their steps and limits are in ``tools/gpu/check.py``; the report writer in ``tools/gpu/report.py``; the
machine's environment and GPU memory timeline in ``tools/gpu/machine.py``. docs/gpu.md has the figures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.check import main  # tools/ is on the path above: it is not a package

if __name__ == "__main__":
    sys.exit(main())
