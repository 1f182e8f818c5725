"""``torchrun`` that exits 0 after a clean preemption: ``python -m megatron_pacs.torchrun`` takes torchrun's flags.

A scheduler preempting a job (Slurm before it kills) sends SIGTERM to every process, torch elastic's agent
included. With ``--exit-signal-handler`` the ranks finish the step, save and exit 0 (the agent waits up to
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds for them), but the agent turns its own SIGTERM into a ``SignalException``
and exits 1 whatever they did. Here each rank that stopped cleanly reports it
(:func:`megatron_pacs.utils.exit_signal.report_clean_stop`) in a directory this launcher creates; when the agent
ends on a signal and every local rank reported, the launcher exits 0. Anything else is torchrun's own outcome.

A batch script cannot tell that clean stop from a finished run by the exit status (both 0; Slurm never requeues
either). With :data:`STOP_MARKER_ENV` set to a path, the launcher writes there, on a clean stop only, a small JSON
marker: the signal, the number of local ranks, this host and the step of the run's latest checkpoint (read from the
trainer's ``--save``). examples/slurm/ removes a stale marker before each launch and requeues the job when every
node left one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from megatron_pacs.utils.exit_signal import STOPS_ENV
from megatron_pacs.utils.logging import get_logger

__all__ = [
    "STOP_MARKER_ENV",
    "all_ranks_stopped_cleanly",
    "forward_stack_dump_requests",
    "latest_saved_step",
    "main",
    "write_stop_marker",
]

log = get_logger("torchrun")

STOP_MARKER_ENV = "MEGATRON_PACS_STOP_MARKER"
"""Where the launcher writes its JSON marker after a clean stop on a signal (unset: no marker)."""


def all_ranks_stopped_cleanly(stops: Path) -> bool:
    """Whether every local rank reported a clean stop in ``stops`` (each report holds the local world size)."""
    reports = [p.read_text() for p in stops.iterdir()]
    return bool(reports) and all(r == str(len(reports)) for r in reports)


def latest_saved_step(argv: list[str]) -> int | None:
    """The step of the latest checkpoint under the trainer's ``--save`` in ``argv`` (None: no --save, no checkpoint).

    Args:
        argv: The launcher's arguments (the trainer's follow its module or script).
    """
    save = _flag_value(argv, "--save")
    config = _flag_value(argv, "--config")
    if save is None and config is not None:  # --save given in the run's --config file only
        try:
            import yaml

            section = (yaml.safe_load(Path(config).read_text()) or {}).get("checkpoint") or {}
            save = section.get("save") if isinstance(section, dict) else None
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            save = None
    try:
        return int(Path(save, "latest_checkpointed_iteration.txt").read_text().strip()) if save else None
    except (OSError, ValueError):
        return None


def _flag_value(argv: list[str], name: str) -> str | None:
    """The last value of ``name`` in ``argv`` (``--name VALUE`` or ``--name=VALUE``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
    return value


def write_stop_marker(path: Path, signal_name: str, local_ranks: int, step: int | None) -> None:
    """Write the clean-stop marker atomically (a reader never sees half a file).

    Args:
        path: The marker's path (its folder is created).
        signal_name: The signal the agent got, e.g. ``SIGTERM``.
        local_ranks: How many local ranks reported a clean stop.
        step: The latest checkpoint's step (None when unknown).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    marker = {
        "stopped_on": signal_name,
        "local_ranks": local_ranks,
        "step": step,
        "host": socket.gethostname(),
        "time": time.time(),
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(marker) + "\n")
    tmp.replace(path)


def forward_stack_dump_requests() -> None:
    """Pass SIGUSR1 on to the ranks (every process below this one) instead of dying of it.

    torch elastic's agent does not handle SIGUSR1, whose default action ends a process: ``scancel --signal=USR1``
    (which signals every process of the job step) would end the launcher, and with it the job, rather than ask the
    ranks for their stacks (``<log-dir>/stacks/``, docs/architecture.md §6.1). A rank that got the signal directly
    gets it once more from here and writes a second dump, which is harmless.
    """
    import psutil

    def forward(signum: int, frame: object) -> None:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, forward)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    forward_stack_dump_requests()
    with tempfile.TemporaryDirectory(prefix="megatron_pacs_stops_") as stops:
        os.environ[STOPS_ENV] = stops  # the ranks inherit it
        try:
            torchrun(argv)
        except SignalException as exc:
            if not all_ranks_stopped_cleanly(Path(stops)):
                raise
            log.warning("torchrun: got %s; every local rank stopped cleanly on it: exiting 0", exc.sigval.name)
            if marker := os.environ.get(STOP_MARKER_ENV):
                args = sys.argv[1:] if argv is None else argv
                step = latest_saved_step(args)
                write_stop_marker(Path(marker), exc.sigval.name, len(list(Path(stops).iterdir())), step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
