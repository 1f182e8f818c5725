"""``torchrun`` that exits 0 after a clean preemption: ``python -m megatron_pacs.torchrun`` takes torchrun's flags.

A scheduler preempting a job (Slurm before it kills) sends SIGTERM to every process, torch elastic's agent
included. With ``--exit-signal-handler`` the ranks finish the step, save and exit 0 (the agent waits up to
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds for them), but the agent turns its own SIGTERM into a ``SignalException``
and exits 1 whatever they did. Here each rank that stopped cleanly reports it
(:func:`megatron_pacs.utils.exit_signal.report_clean_stop`) in a directory this launcher creates; when the agent
ends on a signal and every local rank reported, the launcher exits 0. Anything else is torchrun's own outcome.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from megatron_pacs.utils.exit_signal import STOPS_ENV
from megatron_pacs.utils.logging import get_logger

__all__ = ["all_ranks_stopped_cleanly", "main"]

log = get_logger("torchrun")


def all_ranks_stopped_cleanly(stops: Path) -> bool:
    """Whether every local rank reported a clean stop in ``stops`` (each report holds the local world size)."""
    reports = [p.read_text() for p in stops.iterdir()]
    return bool(reports) and all(r == str(len(reports)) for r in reports)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    with tempfile.TemporaryDirectory(prefix="megatron_pacs_stops_") as stops:
        os.environ[STOPS_ENV] = stops  # the ranks inherit it
        try:
            torchrun(argv)
        except SignalException as exc:
            if not all_ranks_stopped_cleanly(Path(stops)):
                raise
            log.warning("torchrun: got %s; every local rank stopped cleanly on it: exiting 0", exc.sigval.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
