"""Metric sinks: one :class:`MetricsWriter` fanning out to the console, TensorBoard, W&B and a JSONL file.

The JSONL file (``<log_dir>/metrics.jsonl``) is the durable record: one flat line per :meth:`MetricsWriter.log`
call, ``{"step": 3, "rollout/reward_mean": 0.41, ...}``, appended and flushed at once so a crashed run keeps
everything it logged. Non-finite values are written as ``null`` (JSON has no NaN) and read back as NaN by
:func:`read_metrics`. Tools such as ``tools/plot_metrics.py`` read it back. A write into the log dir that fails (a
full disk) raises :class:`~megatron_pacs.utils.log_writes.LogWriteError` naming the file, the step and the OS error.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from megatron_pacs.utils.log_writes import LogWriteError, log_write
from megatron_pacs.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["CONFIG_FILE", "CONSOLE_FIELDS", "METRICS_FILE", "MetricsWriter", "read_metrics"]

logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
"""The run's resolved configuration beside its metrics: ``--config`` reads it back (docs/training.md)."""
WANDB_ID_FILE = "wandb_run_id.txt"
"""The W&B run of a log dir: a resumed run (``start_step > 0``) continues it instead of starting another."""

# The console line: (candidate keys, template). The first candidate present in a log() call is shown;
# ``{key}`` is the key that matched, ``{value}`` its formatted value.
CONSOLE_FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("rollout/reward_mean",), "reward {value}"),
    (("train/loss", "pacs/loss", "grpo/loss"), "{key} {value}"),
    (("pacs/critic_acc",), "critic_acc {value}"),
    (("rollout/response_len_mean",), "resp_len {value}"),
    (("perf/time/step", "perf/step_time"), "step {value}s"),
    (("perf/tokens_per_sec", "perf/throughput"), "{value} tok/s"),
)


def _to_float(key: str, value: Any) -> float:
    # torch is not imported here: this module is on the entry point's import path, which each spawned helper (the
    # reward workers, the checkpoint writer's queue server) imports again; a tensor exists only once torch is loaded
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar (e.g. .mean())")
        return float(value.detach().float().cpu().item())
    if isinstance(value, str):
        raise TypeError(f"metric {key!r} is a string; log text with MetricsWriter.log_text")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r} has type {type(value).__name__}, not a number or scalar tensor") from e


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _console_line(step: int, total_steps: int | None, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    for candidates, template in CONSOLE_FIELDS:
        key = next((k for k in candidates if k in metrics), None)
        if key is not None:
            parts.append(template.format(key=key, value=_fmt(metrics[key])))
    for key in sorted(k for k in metrics if k.startswith("val/") and k.endswith("/reward_mean")):
        parts.append(f"{key.removesuffix('/reward_mean')} {_fmt(metrics[key])}")
    return " | ".join(parts)


def _quiet_tensorboard_write_errors() -> None:
    """TensorBoard writes its events in a thread of its own; an ``OSError`` there (a full disk) is kept and raised
    again in the caller's next write or flush, where :class:`MetricsWriter` names it in one line. The thread's own
    traceback (``threading.excepthook``) would print it a second time, at length: it is not printed."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    before = threading.excepthook
    if getattr(before, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        before(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _parse_line(line: str) -> dict[str, Any] | None:
    """The record on one JSONL line, or None when the line is corrupt or has no integer ``step``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    return row


def _truncate_from(path: Path, start_step: int) -> None:
    """Rewrite ``path`` atomically, keeping only well-formed lines whose step is below ``start_step``."""
    kept, dropped, corrupt = [], 0, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = _parse_line(line)
            if row is None:
                corrupt += 1
            elif row["step"] < start_step:
                kept.append(line.rstrip("\n") + "\n")
            else:
                dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if dropped or corrupt:
        logger.info(
            "resuming at step %d: dropped %d lines with step >= %d and %d corrupt lines from %s",
            start_step,
            dropped,
            start_step,
            corrupt,
            path,
        )


SAMPLE_MAX_CHARS = 10_000
"""The longest text of one sample :meth:`MetricsWriter.log_samples` records (the rollout dumps keep it whole)."""


def _sample_value(value: Any) -> Any:
    if isinstance(value, str) and len(value) > SAMPLE_MAX_CHARS:
        return value[:SAMPLE_MAX_CHARS] + f" [... {len(value) - SAMPLE_MAX_CHARS} more characters]"
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _samples_markdown(columns: list[str], rows: list[list[Any]]) -> str:
    """Each sample as a line of its short fields and an indented (verbatim) block per text field."""
    parts = []
    for i, row in enumerate(rows):
        short = [f"**{c}** `{v}`" for c, v in zip(columns, row, strict=True) if not _is_text_block(v)]
        parts.append(f"#### sample {i}\n\n" + " · ".join(short))
        for c, v in zip(columns, row, strict=True):
            if _is_text_block(v):
                parts.append(f"**{c}**\n\n" + "\n".join("    " + line for line in str(v).splitlines() or [""]))
    return "\n\n".join(parts)


def _is_text_block(value: Any) -> bool:
    """Prose (a prompt, a response) gets a block of its own; a short token (an id, an answer) stays in the line."""
    return isinstance(value, str) and (any(c.isspace() for c in value) or "`" in value or len(value) > 60)


def _write_config_file(path: Path, config: Mapping[str, Any]) -> None:
    """``config`` as YAML at ``path``, replaced whole (a crash leaves the old file or the new one).

    It is read back by ``--config <log-dir>/config.yaml --log-dir NEW [--save NEW_CKPT]`` to run the run again, so
    two of the run's own places are left out: ``log_dir`` (the folder holds this run: one run per --log-dir), and a
    ``load`` of ``--save``'s own checkpoints (a requeued job's ``--load`` = ``--save``: the rerun would resume this
    run instead of running it again). ``save`` stays, with the rest of the checkpoint settings; the header says that
    a rerun gives a ``--save`` of its own (a fresh run is refused over this run's checkpoints).
    """
    import yaml

    config = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    if isinstance(config.get("run"), dict):
        config["run"].pop("log_dir", None)
    ck = config.get("checkpoint")
    save = ck.get("save") if isinstance(ck, dict) else None
    header = (
        f"# This run's resolved configuration but --log-dir; `python -m megatron_pacs.train --config {path} "
        "--log-dir NEW` runs it again.\n"
    )
    if isinstance(ck, dict) and save:
        header += f"# It saved its checkpoints to {save}: give the rerun its own, --save NEW_CKPT.\n"
        load = ck.get("load")
        if load and _within(str(load), str(save)):
            ck["load"] = None
            header += f"# load: {load} (this run's own checkpoints) is left out: a rerun starts afresh.\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)


def _within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies inside it (after resolving both)."""
    a, b = os.path.realpath(path), os.path.realpath(root)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


class MetricsWriter:
    """Fan metrics out to the console, TensorBoard, Weights & Biases and ``<log_dir>/metrics.jsonl``.

    Create one on the logging rank (``enabled=False`` elsewhere, which turns every method into a no-op) and
    call :meth:`log` once or more per step. Usable as a context manager; :meth:`close` is idempotent.

    Args:
        log_dir (str | Path | None): Run directory for ``metrics.jsonl``, ``tensorboard/`` and ``wandb/``.
            None logs to the console (and W&B, if asked) only.
        enabled (bool): False makes the writer do nothing at all (no files, no console lines).
        tensorboard (bool): Write TensorBoard events under ``<log_dir>/tensorboard``.
        wandb_project (str | None): W&B project; None disables W&B. Without ``WANDB_API_KEY`` and with no
            ``WANDB_MODE`` set, the run is logged offline (sync it later with ``wandb sync``).
        wandb_name (str | None): W&B run name.
        config (dict | None): Run configuration, sent to W&B, shown as text in TensorBoard and written to
            ``<log_dir>/config.yaml`` (which ``--config`` reads back).
        total_steps (int | None): Shown as ``step 3/20`` on the console.
        start_step (int): The step a resumed run restarts at; lines with ``step >= start_step`` are removed from
            an existing ``metrics.jsonl`` (and TensorBoard events from then on are purged) so the record holds
            each step once.
        fresh (bool): This run starts at its first step: an existing ``metrics.jsonl`` can only be an earlier
            attempt of the same job that ended before its first checkpoint (:mod:`megatron_pacs.outputs` refuses
            any other), so its lines go too.

    Raises:
        ValueError: If ``start_step`` or ``total_steps`` is negative.
    """

    def __init__(
        self,
        log_dir: str | Path | None,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_name: str | None = None,
        config: dict | None = None,
        total_steps: int | None = None,
        start_step: int = 0,
        fresh: bool = False,
    ) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 or None, got {total_steps}")
        self.enabled, self.fresh = enabled, fresh
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.total_steps = total_steps
        self.wandb_mode: str | None = None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._closed = False
        self._failed = False  # a write failed: close() then drops what it cannot write
        if not enabled:
            return
        if self.log_dir is not None:
            with self._writing(self.log_dir / METRICS_FILE, start_step):
                self.log_dir.mkdir(parents=True, exist_ok=True)
                self._open_jsonl(self.log_dir / METRICS_FILE, start_step)
            if config:
                with self._writing(self.log_dir / CONFIG_FILE, start_step):
                    _write_config_file(self.log_dir / CONFIG_FILE, config)
            if tensorboard:
                with self._writing(self.log_dir / "tensorboard", start_step):
                    self._open_tensorboard(config, start_step)
        if wandb_project:
            self._open_wandb(wandb_project, wandb_name, config, start_step)

    @contextmanager
    def _writing(self, path: Path, step: int | None) -> Iterator[None]:
        """:func:`~megatron_pacs.utils.log_writes.log_write`, remembering the failure (for :meth:`close`)."""
        try:
            with log_write(path, step):
                yield
        except Exception:
            self._failed = True
            raise

    @property
    def jsonl_path(self) -> Path | None:
        """``<log_dir>/metrics.jsonl``, or None without a log dir."""
        return self.log_dir / METRICS_FILE if self.log_dir is not None else None

    def _open_jsonl(self, path: Path, start_step: int) -> None:
        if path.exists():
            if start_step > 0 or self.fresh:
                _truncate_from(path, start_step)
            elif path.stat().st_size > 0:
                logger.warning("%s already exists and start_step is 0; appending to it", path)
        needs_newline = False
        if path.exists() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._jsonl = open(path, "a", encoding="utf-8")  # closed in close()
        if needs_newline:  # a crash mid-line left a partial record; keep the next record on its own line
            self._jsonl.write("\n")
            self._jsonl.flush()

    def _open_tensorboard(self, config: dict | None, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        assert self.log_dir is not None
        _quiet_tensorboard_write_errors()
        self._tb = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=start_step or None)
        if config:
            self._tb.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", start_step)

    def _open_wandb(self, project: str, name: str | None, config: dict | None, start_step: int) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE")
        if not mode:
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            if mode == "offline":
                logger.info("W&B: no WANDB_API_KEY and no WANDB_MODE set; logging offline (upload with `wandb sync`)")
        self.wandb_mode = mode
        id_file = self.log_dir / WANDB_ID_FILE if self.log_dir is not None else None
        run_id = None
        if id_file is not None and start_step > 0 and id_file.is_file():
            run_id = id_file.read_text().strip() or None  # a resumed run continues its W&B run
            logger.info("W&B: resuming run %s at step %d", run_id, start_step)
        self._wandb = wandb.init(
            project=project,
            name=name,
            dir=str(self.log_dir) if self.log_dir is not None else None,
            config=config,
            mode=cast(Literal["online", "offline", "disabled", "shared"], mode),  # wandb validates WANDB_MODE itself
            id=run_id,
            resume="allow" if run_id else None,
        )
        if id_file is not None and self._wandb is not None:
            id_file.write_text(self._wandb.id + "\n")

    def log(self, step: int, metrics: Mapping[str, float | int | torch.Tensor]) -> None:
        """Record ``metrics`` at ``step`` everywhere and print one console line.

        Args:
            step (int): Training step (the x axis everywhere).
            metrics (Mapping[str, float | int | torch.Tensor]): Flat ``name -> scalar``; tensors must hold one
                element. NaN/inf are kept (``null`` in the JSONL file).

        Raises:
            ValueError: If a key is ``"step"`` or a tensor has more than one element.
            TypeError: If a value is not a number or scalar tensor.
        """
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsWriter.log called after close()")
        step = int(step)
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if key == "step":
                raise ValueError("'step' is reserved in metrics.jsonl; pass the step as the first argument")
            values[str(key)] = _to_float(key, value)
        if self._jsonl is not None:
            row = {"step": step, **{k: v if math.isfinite(v) else None for k, v in values.items()}}
            with self._writing(Path(self._jsonl.name), step):
                self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
                self._jsonl.flush()
        if self._tb is not None:
            with self._writing(Path(self._tb.log_dir), step):
                for key, value in values.items():
                    self._tb.add_scalar(key, value, step)
                self._tb.flush()  # its thread's write error, if any, is this step's (not the next one's)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        logger.info(_console_line(step, self.total_steps, values))

    def log_text(self, step: int, key: str, text: str) -> None:
        """Record a text sample (e.g. a decoded rollout) in TensorBoard and W&B.

        Args:
            step (int): Training step.
            key (str): Tag, e.g. ``"samples/rollout"``.
            text (str): The text; shown preformatted.
        """
        if not self.enabled:
            return
        if self._tb is not None:
            with self._writing(Path(self._tb.log_dir), int(step)):
                self._tb.add_text(key, "```\n" + text + "\n```", int(step))
        if self._wandb is not None:
            import html

            import wandb

            self._wandb.log({key: wandb.Html("<pre>" + html.escape(text) + "</pre>")}, step=int(step))

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]], key: str = "samples") -> None:
        """Record a few of the step's generations (e.g. the rollout dump's records: ``input``, ``output``,
        ``ground_truth``, ``score``): one text entry in TensorBoard, one ``wandb.Table`` in W&B; not in the JSONL
        file or on the console. Texts over :data:`SAMPLE_MAX_CHARS` are cut there.

        Args:
            step (int): Training step.
            samples (Sequence[Mapping[str, Any]]): One flat record per generation; the columns are the first
                record's keys (``step`` left out: it is the x axis). Empty: nothing is logged.
            key (str): Tag / W&B key.
        """
        if not self.enabled or not samples:
            return
        columns: list[Any] = [c for c in samples[0] if c != "step"]  # W&B's column type: str among others
        rows = [[_sample_value(record.get(c)) for c in columns] for record in samples]
        if self._tb is not None:
            with self._writing(Path(self._tb.log_dir), int(step)):
                self._tb.add_text(key, _samples_markdown(columns, rows), int(step))
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=int(step))

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (the JSONL file is flushed on every log call)."""
        if self._tb is not None:
            with self._writing(Path(self._tb.log_dir), None):
                self._tb.flush()

    def close(self) -> None:
        """Flush and close every sink; safe to call twice. After a failed write (its error already raised), what
        cannot be written is dropped without a second error.

        Raises:
            LogWriteError: When closing a file fails (a full disk) and no write had failed before.
        """
        if self._closed:
            return
        self._closed = True
        failed_before, error = self._failed, None
        files: list[tuple[Callable[[], object], Path]] = []
        if self._jsonl is not None:
            files.append((self._jsonl.close, Path(self._jsonl.name)))
        if self._tb is not None:
            files.append((self._tb.close, Path(self._tb.log_dir)))
        for close, path in files:
            try:
                with self._writing(path, None):
                    close()
            except LogWriteError as exc:  # the other sinks are closed all the same
                error = error or exc
        if self._wandb is not None:
            self._wandb.finish()
        if error is not None and not failed_before:
            raise error

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path_or_run_dir: str | Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` written by :class:`MetricsWriter`.

    Args:
        path_or_run_dir (str | Path): The file, or the run directory holding ``metrics.jsonl``.

    Returns:
        list[dict[str, Any]]: One dict per line in file order, ``{"step": int, key: float, ...}``; ``null``
        values come back as NaN. Blank lines are skipped; corrupt lines (e.g. a record cut short by a crash)
        are skipped with a warning.

    Raises:
        FileNotFoundError: If there is no such file.
    """
    path = Path(path_or_run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = _parse_line(line)
            if row is None:
                logger.warning("%s:%d: skipping a corrupt line: %.80s", path, lineno, line.rstrip())
                continue
            rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
    return rows
