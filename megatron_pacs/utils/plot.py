"""Metric curves of one or more runs as a PNG (the engine behind tools/plot_metrics.py and the demo's plot)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_pacs.utils.sinks import METRICS_FILE, read_metrics

DEFAULT_KEYS = ("rollout/reward_mean", "train/loss", "pacs/critic_acc", "rollout/response_len_mean")
# A panel for one of these keys shows, per run, the first alternative that run logged.
ALIASES = {"train/loss": ("train/loss", "pacs/loss", "grpo/loss")}


def _die(msg: str) -> SystemExit:
    return SystemExit(f"plot_metrics: error: {msg}")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key``, sorted by step; a step logged twice keeps its last value."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            by_step[row["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _panels(keys: Sequence[str] | None, available: set[str]) -> list[tuple[str, ...]]:
    """One tuple of alternative keys per panel, keeping only panels some run has."""
    if keys is None:
        panels: list[tuple[str, ...]] = [ALIASES.get(k, (k,)) for k in DEFAULT_KEYS]
        panels = [p for p in panels if available.intersection(p)]
        if not panels:
            raise _die(f"none of the default keys {list(DEFAULT_KEYS)} is logged; available: {sorted(available)}")
        return panels
    panels = []
    for key in keys:
        if any(c in key for c in "*?["):
            matches = sorted(k for k in available if fnmatch.fnmatchcase(k, key))
            if not matches:
                raise _die(f"no run has a key matching {key!r}; available: {sorted(available)}")
            panels.extend((m,) for m in matches)
        else:
            alts = ALIASES.get(key, (key,))
            if not available.intersection(alts):
                raise _die(f"no run has the key {key!r}; available: {sorted(available)}")
            panels.append(alts)
    return panels


def build_figure(
    run_dirs: Sequence[str | Path],
    keys: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    smooth: int = 1,
) -> Figure:
    """Draw the curves of several runs overlaid, one panel per key.

    Args:
        run_dirs (Sequence[str | Path]): Run directories, each holding ``metrics.jsonl``.
        keys (Sequence[str] | None): Metric keys or globs, one panel each; None for the default 2x2 grid.
        labels (Sequence[str] | None): Legend label per run; default: each run directory's name.
        smooth (int): Trailing moving-average window in points; 1 draws the raw values only.

    Returns:
        Figure: The figure (Agg canvas, no pyplot state).

    Raises:
        SystemExit: With a message, for a run without ``metrics.jsonl``, a key no run has, or bad arguments.
    """
    if not run_dirs:
        raise _die("give at least one run directory")
    if smooth < 1:
        raise _die(f"--smooth must be >= 1, got {smooth}")
    if labels is None:
        labels = [(Path(d).parent if Path(d).is_file() else Path(d)).resolve().name for d in run_dirs]
    elif len(labels) != len(run_dirs):
        raise _die(f"got {len(labels)} labels for {len(run_dirs)} run directories; give one label per run")
    runs = []
    for run_dir in run_dirs:
        path = Path(run_dir)
        if not (path / METRICS_FILE).is_file() and not (path.is_file() and path.suffix == ".jsonl"):
            raise _die(f"{run_dir} has no {METRICS_FILE}")
        runs.append(read_metrics(path))
    available = {k for rows in runs for row in rows for k in row if k != "step"}
    panels = _panels(keys, available)

    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, alts in zip(axes, panels, strict=False):
        used = []
        for i, (rows, label) in enumerate(zip(runs, labels, strict=True)):
            key = next((k for k in alts if any(k in row for row in rows)), None)
            if key is None:
                continue
            steps, values = _series(rows, key)
            if not steps:
                continue
            used.append(key)
            color = f"C{i}"
            if smooth > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, _smooth(values, smooth), color=color, label=label, linewidth=1.6)
            else:
                ax.plot(steps, values, color=color, label=label, linewidth=1.4, marker="." if len(steps) < 30 else "")
        ax.set_title(" / ".join(dict.fromkeys(used)) or alts[0], fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if used:
            ax.legend(fontsize=8)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    keys: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    smooth: int = 1,
) -> Path:
    """Plot several runs' metrics overlaid and save the figure.

    Args:
        run_dirs (Sequence[str | Path]): Run directories, each holding ``metrics.jsonl``.
        out (str | Path): Image path (``.png``; any format matplotlib knows by suffix works).
        keys (Sequence[str] | None): Metric keys or globs, one panel each; None for the default 2x2 grid.
        labels (Sequence[str] | None): Legend label per run; default: each run directory's name.
        smooth (int): Trailing moving-average window in points.

    Returns:
        Path: ``out``.

    Raises:
        SystemExit: With a message, for a run without ``metrics.jsonl``, a key no run has, or bad arguments.
    """
    fig = build_figure(run_dirs, keys=keys, labels=labels, smooth=smooth)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
