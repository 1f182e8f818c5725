"""A rank for tests/test_torchrun.py: waits for SIGTERM, then stops as ``--exit-signal-handler`` does (reports a
clean stop and exits 0), or with ``fail`` on local rank 1 exits 1 without reporting. A SIGUSR1 (a stack-dump
request) leaves a file ``usr1.<local rank>``."""

import os
import signal
import sys
import time
from pathlib import Path

from megatron_pacs.utils.exit_signal import report_clean_stop

got: list[int] = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
signal.signal(signal.SIGUSR1, lambda signum, frame: Path(sys.argv[1], f"usr1.{os.environ['LOCAL_RANK']}").touch())
Path(sys.argv[1], f"ready.{os.environ['LOCAL_RANK']}").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # the step in progress finishes, the checkpoint is saved
if len(sys.argv) > 2 and sys.argv[2] == "fail" and os.environ["LOCAL_RANK"] == "1":
    sys.exit(1)
report_clean_stop()
sys.exit(0)
