"""What the GPU machine is and what ran on it, for tools/gpu_check.py: its environment (GPUs, driver, the installed
stack), its GPU memory over a run, and each test of a pytest run."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def environment() -> dict:
    import torch

    env: dict = {
        "gpus": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": sys.version.split()[0],
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        pass
    for dist in ("transformer-engine", "transformer-engine-torch", "vllm", "megatron-core", "mbridge", "triton", "ray"):
        env[dist] = _version(dist)
    if env["vllm"]:
        probe = "from megatron_pacs.rollout.vllm_backend import vllm_features as f; import json; print(json.dumps(f()))"
        out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
        env["vllm_features"] = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-300:]
    return env


def no_cuda_message() -> str | None:
    """Why this machine cannot run the check, or None when it has a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} (CUDA build {torch.version.cuda})" if torch.version.cuda else "a CPU torch"
        return f"no CUDA GPU visible ({build}): make gpu-check needs a machine with one or more CUDA GPUs"
    return None


class MemoryTimeline:
    """nvidia-smi's used memory per GPU, sampled every ``period`` seconds while a run lasts."""

    def __init__(self, period: float = 0.5) -> None:
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
                self.samples.append((time.time(), [float(x) / 1024 for x in out.split()]))
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
            self._stop.wait(self.period)

    def __enter__(self) -> MemoryTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def summary(self) -> dict:
        """Peak, each large drop of GPU 0's used memory (a phase freeing memory: sleep, offload), in GiB, and the
        timeline itself (``[seconds since the first sample, GiB]``, thinned to about 120 points)."""
        used = [s[1][0] for s in self.samples if s[1]]
        drops, high = [], None
        for value in used:
            high = value if high is None else max(high, value)
            if high - value > 1.0:  # a fall of more than 1 GiB from the running peak
                drops.append(round(high - value, 2))
                high = value
        freed = {f"drop {i + 1}": d for i, d in enumerate(drops[:6])}
        start = self.samples[0][0] if self.samples else 0.0
        timeline = [[round(t - start, 1), round(v[0], 2)] for t, v in self.samples if v]
        timeline = timeline[:: max(1, len(timeline) // 120)]  # at most ~120 points: (seconds, GiB)
        return {"peak_gib": max(used, default=None), "samples": len(used), "freed_gib": freed, "timeline": timeline}


def junit_results(path: Path) -> list[dict]:
    """Per test of a pytest JUnit XML: ``{"id", "status": passed|failed|error|skipped, "reason"}``."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (
                    (child.get("message") or child.text or "").strip().splitlines()[0][:300]
                    if (child.get("message") or child.text)
                    else ""
                )
                break
        tests.append({"id": test_id, "status": status, "reason": reason})
    return tests
