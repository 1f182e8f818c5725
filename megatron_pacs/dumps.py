"""What a run writes beside its metrics for people to read: one JSON-lines file of rollouts per step.

``<log-dir>/rollouts/step_NNNNNN.jsonl``: one line per response (prompt, response text, ground truth, score), the
driver's records of :class:`~megatron_pacs.sources.StepRollouts`. ``--no-dump-rollouts`` turns them off (about 45 MB
per step at recipe scale).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_pacs.config import RunConfig

__all__ = ["dump_rollouts"]


def dump_rollouts(run: RunConfig, step: int, records: Iterable[dict[str, Any]]) -> Path | None:
    """Write step ``step``'s rollout records to ``<--log-dir>/rollouts/step_NNNNNN.jsonl`` unless
    ``--no-dump-rollouts``; returns the file written, if any."""
    if not run.dump_rollouts:
        return None
    folder = Path(run.log_dir) / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path
