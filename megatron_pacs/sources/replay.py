"""The replay source: an earlier run's dumped rollouts, step by step, bit for bit (``--rollout-source replay``).

Step k trains on ``<--replay-from>/rollouts/step_k.safetensors`` exactly as that run did: the same tokens, rewards,
groups and engine log-probs, so from the same weights the update (losses, gradient norms, weights) is the same
bit for bit, and the consistency metrics compare the trainer with the recorded engine log-probs. Imports no Ray,
vLLM or math-verify.

:meth:`ReplaySource.check` runs on every rank before any model is built: a folder without dumps, a missing step,
a truncated dump, another tokenizer, vocabulary, group size, batch size or temperature, prompts or responses longer
than ``--max-prompt-length`` / ``--max-response-length`` are refused naming the file and the
mismatch. A dump's tensors are checked against their SHA-256 when the step loads them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_pacs.config import TrainConfig
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources.base import StepRollouts
from megatron_pacs.sources.dumps import DumpContext, dump_path, load_dump, read_dump_metadata
from megatron_pacs.utils.logging import get_logger

__all__ = ["ReplaySource"]

log = get_logger("replay")


class ReplaySource:
    """Rollouts from ``--replay-from``'s dumps (driver only; :meth:`check` on every rank).

    Args:
        cfg: The run's settings (``--replay-from``, the batch shape, the temperature).
        context: This run's tokenizer fingerprint, vocabulary and temperature.
    """

    fleet = None
    scorer = None

    def __init__(self, cfg: TrainConfig, context: DumpContext) -> None:
        assert cfg.source.replay_from is not None
        self.cfg, self.context = cfg, context
        self.run_dir = Path(cfg.source.replay_from)

    @classmethod
    def open(cls, cfg: TrainConfig, *, tokenizer: Any, log_dir: str, context: DumpContext) -> ReplaySource:
        """The dumps of ``--replay-from``, read step by step (opened on every rank: :meth:`check`)."""
        return cls(cfg, context)

    def check(self, steps: Sequence[int]) -> None:
        """Refuse, before anything is built, dumps that this run cannot replay exactly.

        Args:
            steps: The steps this run will train.

        Raises:
            ValueError: Naming the file and the mismatch.
        """
        folder = self.run_dir / "rollouts"
        if not any(folder.glob("step_*.safetensors")):
            raise ValueError(
                f"--replay-from {self.run_dir}: {folder} holds no rollout dumps (step_*.safetensors); replay the "
                "--log-dir of a run that dumped its rollouts (the default; not --no-dump-rollouts)"
            )
        b, want = self.cfg.batch, self.context
        for step in steps:
            path = dump_path(self.run_dir, step)
            if not path.is_file():
                raise ValueError(
                    f"--replay-from {self.run_dir}: step {step} has no dump ({path}); the run dumped only "
                    f"{_dumped_steps(folder)}: lower --train-iters or replay another run"
                )
            meta = read_dump_metadata(path)
            got = meta["context"]
            for key, name in (
                ("tokenizer_sha256", "tokenizer"),
                ("tokenizer_size", "tokenizer size"),
                ("vocab_size", "vocabulary size"),
                ("temperature", "--temperature"),
            ):
                if got[key] != getattr(want, key):
                    raise ValueError(
                        f"{path}: made with {name} {got[key]!r}, this run has {getattr(want, key)!r}; replay with "
                        "the --hf-model (tokenizer and model) and --temperature of the run that dumped it"
                    )
            if self.cfg.model.router_replay == "r3" and not meta["has_routed_experts"]:
                raise ValueError(
                    f"{path}: no routed experts (dumped by a run without --router-replay r3), and --router-replay r3 "
                    "replays them; use --router-replay off, or replay a run that had it on"
                )
            if meta["group_size"] != b.group_size:
                raise ValueError(f"{path}: group size {meta['group_size']}, this run has --group-size {b.group_size}")
            if len(meta["prompt_ids"]) != b.global_batch_size:
                raise ValueError(
                    f"{path}: {len(meta['prompt_ids'])} prompts, this run has --global-batch-size {b.global_batch_size}"
                )
            _check_lengths(path, b.max_prompt_length, b.max_response_length)

    def collect(self, rows: Sequence[PromptRow], step: int, *, refill: int = 0) -> StepRollouts:
        """Step ``step``'s dumped rollouts (``rows`` only keep the loader's position; a different order is logged).
        There are no refill rounds to replay (``--filter-groups`` is refused with this source)."""
        if refill:
            raise ValueError("--filter-groups: --rollout-source replay replays the dumped batches and cannot refill")
        started = time.perf_counter()
        path = dump_path(self.run_dir, step)
        text = dump_path(self.run_dir, step, ".jsonl")
        records: list[dict[str, Any]] = []
        if text.is_file():
            records = [json.loads(line) for line in text.read_text(encoding="utf-8").splitlines() if line]
        rollouts = load_dump(path, records)
        if rollouts.batch.routed_experts is not None and self.cfg.model.router_replay != "r3":
            rollouts.batch = dataclasses.replace(rollouts.batch, routed_experts=None)  # the routers choose
        ids = [row.id for row in rows]
        if ids != rollouts.prompt_ids:
            log.warning(
                "step %d: the replayed prompts (%s) are not this run's data order (%s): the rollouts are replayed as "
                "dumped; pass the --train-data and --seed of the run that dumped them for its data position",
                step,
                _short(rollouts.prompt_ids),
                _short(ids),
            )
        rollouts.metrics["perf/time/load_rollouts"] = time.perf_counter() - started
        return rollouts

    def close(self) -> None:
        """Nothing to release."""


def _check_lengths(path: Path, max_prompt: int, max_response: int) -> None:
    """Refuse a dump with a prompt or a response longer than this run's limits, naming the file and the flag (reads
    the two small length tensors, ``[S]`` each, not the tokens)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            longest = {name: int(f.get_tensor(name).max()) for name in ("prompt_lens", "response_lens")}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise ValueError(f"{path}: not a readable rollout dump ({exc}); dump the step again") from None
    for name, what, limit in (("prompt_lens", "prompt", max_prompt), ("response_lens", "response", max_response)):
        if longest[name] > limit:
            raise ValueError(
                f"{path}: a {what} of {longest[name]} tokens, over --max-{what}-length {limit}; replay with the "
                f"limits of the run that dumped it (--max-{what}-length {longest[name]} or more)"
            )


def _dumped_steps(folder: Path) -> str:
    steps = sorted(int(p.stem.split("_")[1]) for p in folder.glob("step_*.safetensors"))
    return f"steps {steps[0]}-{steps[-1]} ({len(steps)} dumps)" if steps else "no step"


def _short(ids: Sequence[str]) -> str:
    return ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
