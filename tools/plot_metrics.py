#!/usr/bin/env python
"""Plot training curves from one or more run directories' ``metrics.jsonl``, overlaid, into one PNG.

Without --keys: a 2x2 grid of whichever exist of rollout/reward_mean, train/loss (or pacs/loss, grpo/loss, per
run), pacs/critic_acc and rollout/response_len_mean. A key may be a glob (``val/*/reward_mean``): one panel per
match.

Example:
    python tools/plot_metrics.py runs/pacs runs/grpo --out curves.png --smooth 5
    python tools/plot_metrics.py runs/pacs --out val.png --keys 'val/*/reward_mean' rollout/reward_mean
"""

from __future__ import annotations

import argparse
import sys

from megatron_pacs.utils.plot import DEFAULT_KEYS, build_figure, plot_runs  # noqa: F401 - re-exported


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--out", required=True, help="output image, e.g. curves.png")
    p.add_argument("--keys", nargs="+", default=None, help="metric keys or globs, one panel each")
    p.add_argument("--labels", nargs="+", default=None, help="legend label per run (default: directory name)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in points (default 1: raw)")
    args = p.parse_args(argv)
    out = plot_runs(args.run_dirs, args.out, keys=args.keys, labels=args.labels, smooth=args.smooth)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
