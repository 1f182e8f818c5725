"""Put on a process's PYTHONPATH, this makes Ray, vLLM and math-verify absent from it, as on a bare GPU machine:
``import ray`` raises ModuleNotFoundError and ``importlib.util.find_spec("ray")`` finds nothing (a ``None`` entry in
``sys.modules`` does both, for the packages and their submodules alike). The replay and synthetic rollout sources
must train under it (tests/test_golden_trace.py, tests/sources/test_synthetic_run.py)."""

import sys

for _name in ("ray", "vllm", "math_verify"):
    sys.modules[_name] = None  # type: ignore[assignment]
