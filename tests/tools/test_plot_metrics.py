"""tools/plot_metrics.py: overlaid runs into one PNG, per-run loss fallback, globs, and clear errors."""

import importlib.util
from pathlib import Path

import pytest

from megatron_pacs.utils.sinks import MetricsWriter

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def runs(tmp_path):
    """Two runs: ``pacs`` (pacs/loss, critic_acc, a val key) and ``grpo`` (grpo/loss), 10 steps each."""
    dirs = []
    for name, loss_key in (("pacs", "pacs/loss"), ("grpo", "grpo/loss")):
        run = tmp_path / name
        with MetricsWriter(run, tensorboard=False) as w:
            for step in range(10):
                metrics = {
                    "rollout/reward_mean": step / 10,
                    loss_key: 1.0 - step / 20,
                    "rollout/response_len_mean": 100.0 + step,
                }
                if name == "pacs":
                    metrics["pacs/critic_acc"] = 0.5 + step / 40
                    metrics["val/math500/reward_mean"] = step / 12
                w.log(step, metrics)
        dirs.append(run)
    return dirs


def panel_lines(ax):
    return {line.get_label(): len(line.get_xdata()) for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_two_runs_overlaid_into_a_png(tool, runs, tmp_path):
    out = tool.plot_runs(runs, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000

    fig = tool.build_figure(runs)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in axes]
    assert titles == ["rollout/reward_mean", "pacs/loss / grpo/loss", "pacs/critic_acc", "rollout/response_len_mean"]
    assert panel_lines(axes[0]) == {"pacs": 10, "grpo": 10}
    assert panel_lines(axes[1]) == {"pacs": 10, "grpo": 10}  # each run's own loss key
    assert panel_lines(axes[2]) == {"pacs": 10}


def test_main_with_keys_labels_smoothing_and_glob(tool, runs, tmp_path, capsys):
    out = tmp_path / "val.png"
    argv = [*map(str, runs), "--out", str(out), "--keys", "val/*/reward_mean", "train/loss"]
    assert tool.main([*argv, "--labels", "A", "B", "--smooth", "3"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {out}" in capsys.readouterr().out

    fig = tool.build_figure(runs, keys=["val/*/reward_mean", "train/loss"], labels=["A", "B"], smooth=3)
    val_ax, loss_ax = (ax for ax in fig.axes if ax.get_visible())
    assert val_ax.get_title() == "val/math500/reward_mean" and panel_lines(val_ax) == {"A": 10}
    assert len(loss_ax.get_lines()) == 4  # raw (faint) + smoothed per run
    smoothed = next(line for line in loss_ax.get_lines() if line.get_label() == "A").get_ydata()
    assert smoothed[2] == pytest.approx((1.0 + 0.95 + 0.9) / 3)


def test_missing_key_is_a_clear_error(tool, runs, tmp_path):
    with pytest.raises(SystemExit, match=r"no run has the key 'pacs/nonexistent'; available: .*rollout/reward_mean"):
        tool.main([*map(str, runs), "--out", str(tmp_path / "x.png"), "--keys", "pacs/nonexistent"])
    assert not (tmp_path / "x.png").exists()


def test_run_dir_without_metrics_is_a_clear_error(tool, runs, tmp_path):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"empty_run has no metrics\.jsonl"):
        tool.plot_runs([runs[0], empty], tmp_path / "x.png")
    with pytest.raises(SystemExit, match="one label per run"):
        tool.plot_runs(runs, tmp_path / "x.png", labels=["only-one"])
