"""Offline pass@k evaluation with the PACS protocol (docs/algorithm.md §8.3), resumable, on any rollout engine.

``evaluate`` samples n responses per problem, scores them, and appends one line per problem to
``eval_rollout.jsonl`` as each batch finishes, so an interrupted run resumes where it stopped. The metrics are then
recomputed from that file: ``eval_metrics.json`` (``{data_source: {"pass@1": ..., "pass@2": ...}}``), a markdown
table and a pass@k plot.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_pacs.algo.passk import pass_at_k_curve, powers_of_two_up_to
from megatron_pacs.data.prompts import PromptRow, apply_chat_template
from megatron_pacs.rewards.scorer import RewardScorer
from megatron_pacs.rollout.types import RolloutEngine, SamplingConfig
from megatron_pacs.utils.logging import get_logger

__all__ = ["ROLLOUT_FILE", "evaluate", "passk_metrics", "pending_rows", "read_rollouts", "write_reports"]

log = get_logger("evaluation")

ROLLOUT_FILE = "eval_rollout.jsonl"
METRICS_FILE = "eval_metrics.json"


def read_rollouts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of an ``eval_rollout.jsonl``; a torn last line (a run killed mid-write) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n != len(lines):
                raise ValueError(f"{path}:{n} is not valid JSON; delete the line or the file to re-run it") from None
            log.warning("%s: dropping a torn last line (the previous run stopped mid-write)", path)
    return records


def passk_metrics(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean unbiased pass@k per data source, k = powers of two up to the smallest sample count of that source.

    Args:
        records: Rows with ``data_source`` and ``scores`` (0/1 per sample).

    Returns:
        ``{data_source: {"pass@1": ..., "pass@2": ...}}``, sources sorted by name.
    """
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for r in records:
        by_source[r["data_source"]].append([float(s) for s in r["scores"]])
    out = {}
    for source in sorted(by_source):
        scores = by_source[source]
        out[source] = pass_at_k_curve(scores, powers_of_two_up_to(min(len(s) for s in scores)))
    return out


def write_reports(out_dir: str | os.PathLike, metrics: dict[str, dict[str, float]], plot: bool = True) -> None:
    """Write ``eval_metrics.json`` (atomically), ``eval_metrics.md`` and, with ``plot``, ``eval_passk.png``."""
    out_dir = Path(out_dir)
    tmp = out_dir / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / METRICS_FILE)
    ks = sorted({k for m in metrics.values() for k in m}, key=lambda k: int(k.split("@")[1]))
    lines = ["| data_source | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks)]
    for source, m in metrics.items():
        lines.append(f"| {source} | " + " | ".join(f"{100 * m[k]:.2f}" if k in m else "" for k in ks) + " |")
    (out_dir / "eval_metrics.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if plot and metrics:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for source, m in metrics.items():
            kk = sorted(int(k.split("@")[1]) for k in m)
            ax.plot(kk, [100 * m[f"pass@{k}"] for k in kk], marker="o", label=source)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "eval_passk.png", dpi=120)


def _key(row: dict[str, Any] | PromptRow) -> tuple[str, str]:
    if isinstance(row, PromptRow):
        return row.data_source, row.id
    return row["data_source"], str(row["id"])


def pending_rows(rows: Sequence[PromptRow], out_dir: str | os.PathLike) -> list[PromptRow]:
    """The rows not yet recorded in ``out_dir/eval_rollout.jsonl``."""
    done = {_key(r) for r in read_rollouts(Path(out_dir) / ROLLOUT_FILE)}
    return [r for r in rows if _key(r) not in done]


def evaluate(
    engine: RolloutEngine | None,
    tokenizer: Any,
    rows: Sequence[PromptRow],
    out_dir: str | os.PathLike,
    sampling: SamplingConfig,
    *,
    scorer: RewardScorer,
    batch_size: int = 64,
    plot: bool = True,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Sample, score and record every problem not yet in ``out_dir/eval_rollout.jsonl``, then write the metrics.

    Args:
        engine: Any rollout engine (a fleet or one engine); may be None when every row is already recorded.
        tokenizer: The model's tokenizer (its chat template builds the prompts).
        rows: Problems from one or more data sources.
        out_dir: Output folder (created).
        sampling: ``n`` samples per problem and the sampling settings.
        scorer: The reward scorer (math-verify with timeouts).
        batch_size: Problems per generation call; also the unit of resumption.

    Returns:
        The pass@k metrics per data source.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ROLLOUT_FILE
    done_records = read_rollouts(path)
    if done_records:  # rewrite without a torn tail before appending
        path.write_text("".join(json.dumps(r) + "\n" for r in done_records), encoding="utf-8")
    done = {_key(r) for r in done_records}
    todo = [r for r in rows if _key(r) not in done]
    log.info(
        "evaluate: %d problems, %d already in %s, %d to run (n=%d)",
        len(rows),
        len(rows) - len(todo),
        path,
        len(todo),
        sampling.n,
    )
    if todo and engine is None:
        raise ValueError("evaluate: problems remain to be sampled but no engine was given")
    with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc="evaluate", disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            assert engine is not None  # checked above: todo is not empty
            batch = todo[start : start + batch_size]
            prompts = [apply_chat_template(tokenizer, r.prompt) for r in batch]
            groups = engine.generate(prompts, sampling)
            texts = [resp.text for g in groups for resp in g.responses]
            truths = [r.ground_truth for r in batch for _ in range(sampling.n)]
            result = scorer.score(texts, truths)
            for i, (row, group) in enumerate(zip(batch, groups, strict=True)):
                scores = result.scores[i * sampling.n : (i + 1) * sampling.n]
                record = {
                    "id": row.id,
                    "data_source": row.data_source,
                    "question": row.question,
                    "ground_truth": row.ground_truth,
                    "prompt": row.prompt,
                    "responses": [r.text for r in group.responses],
                    "finish_reasons": [r.finish_reason for r in group.responses],
                    "scores": scores,
                }
                f.write(json.dumps(record) + "\n")
            f.flush()
            bar.update(len(batch))
    wanted = {_key(r) for r in rows}
    records = [r for r in read_rollouts(path) if _key(r) in wanted]
    metrics = passk_metrics(records)
    write_reports(out_dir, metrics, plot=plot)
    return metrics
