#!/usr/bin/env python3
"""Re-render a finished GPU check's report: ``python3 tools/gpu_report.py gpu-report/results.json``.

The report writer lives in ``tools/gpu/report.py``; this entry keeps the command the GPU bundles call.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.report import main  # tools/ is on the path above: it is not a package

if __name__ == "__main__":
    sys.exit(main())
