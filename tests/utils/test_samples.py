"""``--log-samples N``: a few generations per step (prompt, response, ground truth, reward) reach TensorBoard as text
and W&B (offline, no account) as a table, and stay out of metrics.jsonl and the console."""

import json
import logging

from megatron_pacs.utils.sinks import SAMPLE_MAX_CHARS, MetricsWriter, read_metrics

RECORDS = [
    {
        "step": 2,
        "id": "7",
        "input": "What is 3 + 4?",
        "output": "3 + 4 = \\boxed{7}",
        "ground_truth": "7",
        "score": 1.0,
    },
    {
        "step": 2,
        "id": "7",
        "input": "What is 3 + 4?",
        "output": "line one\nthen \\boxed{8}",
        "ground_truth": "7",
        "score": 0.0,
    },
]


def test_samples_reach_tensorboard_as_text_and_not_the_jsonl_or_console(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with caplog.at_level(logging.INFO, logger="megatron_pacs"):
        with MetricsWriter(tmp_path) as w:
            w.log_samples(2, RECORDS)
            w.log_samples(3, [])  # nothing to show: nothing logged
            w.log(2, {"rollout/reward_mean": 0.5})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Tensors("samples/text_summary")
    assert [e.step for e in events] == [2]
    text = events[0].tensor_proto.string_val[0].decode()
    assert "**score** `1.0`" in text and "**ground_truth** `7`" in text and "    What is 3 + 4?" in text
    assert "    line one\n    then \\boxed{8}" in text  # a multi-line response stays verbatim (indented block)
    assert read_metrics(tmp_path) == [{"step": 2, "rollout/reward_mean": 0.5}]
    assert not any("boxed" in r.getMessage() for r in caplog.records)


def test_samples_reach_wandb_offline_as_a_table(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / f"wandb_{name.lower()}"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    long = {**RECORDS[0], "output": "x" * (SAMPLE_MAX_CHARS + 5)}
    with MetricsWriter(tmp_path / "run", tensorboard=False, wandb_project="pacs-test") as w:
        w.log_samples(2, [*RECORDS, long])
    tables = list((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["id", "input", "output", "ground_truth", "score"]
    assert [row[4] for row in table["data"]] == [1.0, 0.0, 1.0]
    assert table["data"][2][2].endswith("[... 5 more characters]")
