"""MetricsWriter (JSONL, resume, TensorBoard, W&B offline, console) and read_metrics."""

import json
import logging
import math
import time

import pytest
import torch

from megatron_pacs.utils.sinks import MetricsWriter, read_metrics


def raw_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_steps(run_dir, steps, **kwargs):
    with MetricsWriter(run_dir, tensorboard=False, **kwargs) as w:
        for s in steps:
            w.log(s, {"loss": float(s)})


def test_jsonl_lines_are_flat_plain_floats_flushed_before_close(tmp_path):
    w = MetricsWriter(tmp_path / "run", tensorboard=False)
    w.log(1, {"a": torch.tensor(0.5), "b": 3, "c": 0.25, "bad": float("nan"), "inf": torch.tensor(float("inf"))})
    w.log(2, {"a": torch.tensor([2.0], dtype=torch.bfloat16)})
    lines = raw_lines(tmp_path / "run")  # read while still open: every call is flushed
    assert lines == [
        {"step": 1, "a": 0.5, "b": 3.0, "c": 0.25, "bad": None, "inf": None},
        {"step": 2, "a": 2.0},
    ]
    assert all(type(v) is float for v in (lines[0]["a"], lines[0]["b"], lines[1]["a"]))
    w.close()
    w.close()  # idempotent
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["step"] == 1 and math.isnan(rows[0]["bad"]) and math.isnan(rows[0]["inf"])
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[1] == {"step": 2, "a": 2.0}


def test_resume_drops_steps_at_or_after_start_step(tmp_path):
    run = tmp_path / "run"
    write_steps(run, range(5))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 5')  # crash mid-record
    write_steps(run, [3, 4], start_step=3)
    assert [r["step"] for r in raw_lines(run)] == [0, 1, 2, 3, 4]
    assert not list(run.glob("*.tmp"))
    write_steps(run, [1], start_step=1)
    assert raw_lines(run) == [{"step": 0, "loss": 0.0}, {"step": 1, "loss": 1.0}]


def test_append_after_torn_line_keeps_new_records_readable(tmp_path, caplog):
    run = tmp_path / "run"
    write_steps(run, [0])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "lo')
    write_steps(run, [1])
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        rows = read_metrics(run)
    assert rows == [{"step": 0, "loss": 0.0}, {"step": 1, "loss": 1.0}]
    assert "corrupt line" in caplog.text


def test_disabled_writer_writes_nothing(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="megatron_pacs"):
        with MetricsWriter(run, enabled=False, wandb_project="p", total_steps=3) as w:
            w.log(0, {"rollout/reward_mean": 1.0})
            w.log_text(0, "sample", "text")
    assert not run.exists()
    assert caplog.records == []


def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path / "run", config={"lr": 1e-6}) as w:
        w.log(0, {"rollout/reward_mean": 0.25})
        w.log(1, {"rollout/reward_mean": torch.tensor(0.75)})
        w.log_text(1, "samples/rollout", "1 + 1 = \\boxed{2}")
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.75)]


def test_console_line_shows_key_metrics(tmp_path, caplog):
    metrics = {
        "rollout/reward_mean": 0.4123,
        "pacs/loss": torch.tensor(0.69314),
        "pacs/critic_acc": 0.62,
        "rollout/response_len_mean": 17.21,
        "perf/time/step": 12.31,
        "perf/tokens_per_sec": 410.4,
        "pacs/weight/mean": 1.0,
    }
    with caplog.at_level(logging.INFO, logger="megatron_pacs"):
        with MetricsWriter(None, total_steps=20) as w:
            w.log(3, metrics)
            w.log(4, {"val/math500/reward_mean": 0.5})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "step 3/20 | reward 0.412 | pacs/loss 0.693 | critic_acc 0.62 | resp_len 17.2 | step 12.3s | 410 tok/s",
        "step 4/20 | val/math500 0.5",
    ]


def test_rejects_bad_values(tmp_path):
    with MetricsWriter(tmp_path / "run", tensorboard=False) as w:
        with pytest.raises(ValueError, match="shape"):
            w.log(0, {"x": torch.ones(2)})
        with pytest.raises(TypeError, match="log_text"):
            w.log(0, {"x": "text"})
        with pytest.raises(ValueError, match="reserved"):
            w.log(0, {"step": 1})
    with pytest.raises(ValueError, match="start_step"):
        MetricsWriter(tmp_path / "run", start_step=-1)


@pytest.mark.parametrize("env_mode", [None, "offline"], ids=["no-key-auto-offline", "WANDB_MODE=offline"])
def test_wandb_without_account_runs_offline(tmp_path, monkeypatch, env_mode):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    start = time.monotonic()
    with MetricsWriter(run, tensorboard=False, wandb_project="pacs-test", wandb_name="t", config={"lr": 1e-6}) as w:
        assert w.wandb_mode == "offline"
        w.log(0, {"rollout/reward_mean": 0.5})
        w.log(1, {"rollout/reward_mean": 0.75})
    assert time.monotonic() - start < 60
    offline_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    records = list(offline_runs[0].glob("run-*.wandb"))
    assert len(records) == 1 and records[0].stat().st_size > 0
    assert [r["rollout/reward_mean"] for r in read_metrics(run)] == [0.5, 0.75]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """The W&B run id is kept in the log dir; a writer resumed at step > 0 continues that run, a fresh
    start (step 0) opens a new one."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / f"wandb_{name.lower()}"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    ids = []
    for start in (0, 2, 0):
        with MetricsWriter(run, tensorboard=False, wandb_project="pacs-test", start_step=start) as w:
            w.log(start + 1, {"rollout/reward_mean": 0.5})
            ids.append(w._wandb.id)
        assert (run / "wandb_run_id.txt").read_text().strip() == ids[-1]
    assert ids[1] == ids[0] and ids[2] != ids[0]
