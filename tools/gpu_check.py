#!/usr/bin/env python3
"""``make gpu-check``: verify the whole GPU path on a machine with one or more CUDA GPUs, in one command.

Runs, each step in its own process with a time limit (all of it within ``--budget-min``, 25 minutes by default on
one H100; a step the budget no longer allows is skipped with that reason), and records every result in
``OUT/results.json`` as it goes (the order below; the 7B, drift and fp32 benchmarks run last, after the end-to-end
runs):

1. the environment: GPUs, driver, torch/CUDA, Transformer Engine, vLLM (and what the engine detected in it),
   Megatron-Core, mbridge;
2. every ``gpu``-marked test (``pytest -m gpu``), each passed / failed / skipped with its reason;
3. the benchmarks: ``bench_logprobs --device cuda``; ``bench_train_step`` at 1.5B without and with TE (padded and
   packed, HF baseline); at 7B TE bf16 vs each FP8 recipe (fwd+bwd); ``bench_fp8_drift``; ``diag_te_fp32``;
4. three PACS steps end to end with a real vLLM CUDA engine on a random-init Qwen2.5-0.5B-shaped model (local
   tokenizer): (a) colocated on one GPU (sleep/wake, ``--weight-sync ipc``, ``--offload-optimizer-during-rollout``),
   with the GPU memory timeline; (b) with two or more GPUs, the engine on its own GPU with the NCCL broadcast;
   (c) an FP8 trainer.

Then ``OUT/report.md`` and ``OUT/report.json`` (tools/gpu_report.py): the figures beside their targets, every test,
and every step that could not run with its reason (no TE, no vLLM, one GPU, too little memory, the time budget).
``--baseline old/report.json`` adds the change of every figure. Without CUDA it says so and exits 2.

Usage: python tools/gpu_check.py [--out gpu-report] [--baseline old/report.json] [--budget-min 25] [--only STEP ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import write_report  # noqa: E402 - the sibling module, importable from any working directory

PY = sys.executable

# Qwen2.5-0.5B's shape (random init; the vocabulary is the local tokenizer's).
E2E_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
E2E_FLAGS = [
    "--train-iters",
    "3",
    "--global-batch-size",
    "8",
    "--ppo-mini-batch-size",
    "4",
    "--group-size",
    "4",
    "--max-prompt-length",
    "128",
    "--max-response-length",
    "128",
    "--bf16",
    "--rollout-dtype",
    "bfloat16",
    "--reward-workers",
    "2",
]


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
        probe = "from megatron_pacs.rollout.vllm_engine import vllm_features as f; import json; print(json.dumps(f()))"
        out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
        env["vllm_features"] = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-300:]
    return env


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
        """Peak, and each large drop of GPU 0's used memory (a phase freeing memory: sleep, offload), in GiB."""
        used = [s[1][0] for s in self.samples if s[1]]
        drops, high = [], None
        for value in used:
            high = value if high is None else max(high, value)
            if high - value > 1.0:  # a fall of more than 1 GiB from the running peak
                drops.append(round(high - value, 2))
                high = value
        freed = {f"drop {i + 1}": d for i, d in enumerate(drops[:6])}
        return {"peak_gib": max(used, default=None), "samples": len(used), "freed_gib": freed}


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, args.out
        self.deadline = time.time() + args.budget_min * 60
        self.results: dict = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "steps": {}}
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        self.results["seconds"] = time.time() - self.t0
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n", encoding="utf-8")

    def skip(self, name: str, reason: str) -> None:
        self.results["steps"][name] = {"status": "skipped", "reason": reason, "seconds": 0.0}
        print(f"== {name}: skipped ({reason})", flush=True)
        self.save()

    def run(self, name: str, cmd: list[str], limit_s: float, **extra) -> dict:
        """Run one step (a subprocess in the project root) within its limit and the overall budget."""
        if self.args.only and name not in self.args.only:
            return {}
        left = self.deadline - time.time()
        if left < 30:
            self.skip(name, f"the {self.args.budget_min}-minute budget is spent")
            return self.results["steps"][name]
        limit = min(limit_s, left)
        print(f"== {name}: {' '.join(cmd)} (limit {limit:.0f} s)", flush=True)
        started = time.time()
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=limit, env=env)
            status = "ok" if proc.returncode == 0 else "failed"
            stdout, stderr = proc.stdout, proc.stderr
            reason = "" if status == "ok" else f"exit {proc.returncode}: {(stderr or stdout).strip()[-300:]}"
        except subprocess.TimeoutExpired as exc:
            status, reason = "timeout", f"stopped after {limit:.0f} s"
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        (self.out / "logs" / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr\n{stderr}")
        step = {
            "status": status,
            "reason": reason,
            "seconds": time.time() - started,
            "cmd": " ".join(cmd),
            "stdout": stdout[-20000:],
            **extra,
        }
        self.results["steps"][name] = step
        print(f"== {name}: {status} in {step['seconds']:.0f} s {reason[:200]}", flush=True)
        self.save()
        return step

    # -- the steps --------------------------------------------------------------------------------------------

    def gpu_tests(self) -> None:
        xml = self.out / "gpu-tests.xml"
        step = self.run(
            "gpu_tests",
            [PY, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rA", f"--junitxml={xml}", "-p", "no:cacheprovider"],
            420,
        )
        if step and xml.exists():
            step["tests"] = junit_results(xml)
            if step["status"] == "failed" and all(t["status"] != "error" for t in step["tests"]):
                step["reason"] = f"{sum(t['status'] == 'failed' for t in step['tests'])} test(s) failed"
            self.save()

    def benchmarks(self, env: dict) -> None:
        """The quick benchmarks (log-probs, 1.5B train step); the long ones come after the end-to-end runs."""
        self.run("bench_logprobs", [PY, "benchmarks/bench_logprobs.py", "--device", "cuda"], 120)
        ts = [PY, "benchmarks/bench_train_step.py", "--shape", "1.5b", "--workdir", str(self.out / "work")]
        self.run("train_step_1.5b_no_te", [*ts, "--impl", "sdpa"], 240)
        if env.get("transformer-engine") is not None:
            self.run("train_step_1.5b_te", [*ts, "--impl", "te", "--variants", "train"], 180)
        else:
            self.skip("train_step_1.5b_te", "Transformer Engine is not installed")

    def long_benchmarks(self, env: dict) -> None:
        memory = env.get("gpu_memory_gib") or 0
        work = str(self.out / "work")
        if env.get("transformer-engine") is not None:
            if memory >= 70:
                self.run(
                    "train_step_7b_fp8",
                    [
                        PY,
                        "benchmarks/bench_train_step.py",
                        "--shape",
                        "7b",
                        "--impl",
                        "te",
                        "--variants",
                        "fwd_bwd",
                        "--layouts",
                        "padded",
                        "--micro-batch-size",
                        "1",
                        "--fp8",
                        "delayed",
                        "tensorwise",
                        "blockwise",
                        "--iters",
                        "3",
                        "--workdir",
                        work,
                    ],
                    240,
                )
            else:
                self.skip("train_step_7b_fp8", f"{memory} GiB of GPU memory; the 7B fwd+bwd needs about 70")
            self.run(
                "bench_fp8_drift", [PY, "benchmarks/bench_fp8_drift.py", "--workdir", work, "--sequences", "4"], 240
            )
            self.run("diag_te_fp32", [PY, "benchmarks/diag_te_fp32.py"], 90)
        else:
            for name in ("train_step_7b_fp8", "bench_fp8_drift", "diag_te_fp32"):
                self.skip(name, "Transformer Engine is not installed")

    def e2e(self, env: dict) -> None:
        names = ("rl_colocated", "rl_broadcast", "rl_fp8")
        if not env.get("vllm"):
            for name in names:
                self.skip(name, "vLLM is not installed")
            return
        setup = self.out / "work" / "rl"
        prep = self.run("rl_setup", [PY, str(Path(__file__).resolve()), "--make-rl-setup", str(setup)], 300)
        if prep.get("status") != "ok":
            for name in names:
                self.skip(name, "the model and data could not be prepared (rl_setup)")
            return
        base = ["--hf-model", str(setup / "model"), "--train-data", str(setup / "train.jsonl"), *E2E_FLAGS]
        train = [PY, "-m", "megatron_pacs.train"]
        self._rl(
            "rl_colocated", [*train, *base, "--colocate", "--weight-sync", "ipc", "--offload-optimizer-during-rollout"]
        )
        if env.get("gpu_count", 1) >= 2:
            self._rl("rl_broadcast", [*train, *base, "--num-engines", "1", "--weight-sync", "broadcast"])
        else:
            self.skip("rl_broadcast", "one GPU: the engine needs a GPU of its own for the NCCL broadcast")
        if env.get("transformer-engine"):
            fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
            colocate = ["--colocate", "--weight-sync", "ipc"] if env.get("gpu_count", 1) < 2 else []
            self._rl("rl_fp8", [*train, *base, *fp8, *colocate])
        else:
            self.skip("rl_fp8", "Transformer Engine is not installed (FP8 needs it)")

    def _rl(self, name: str, cmd: list[str]) -> None:
        log_dir = self.out / "work" / name
        with MemoryTimeline() as timeline:
            step = self.run(name, [*cmd, "--log-dir", str(log_dir)], 300)
        if not step:
            return
        metrics_file = log_dir / "metrics.jsonl"
        if metrics_file.exists():
            step["metrics"] = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        step["memory"] = timeline.summary()
        self.save()

    def main(self) -> int:
        self.t0 = time.time()
        env = self.results["environment"] = environment()
        self.save()
        self.gpu_tests()
        self.benchmarks(env)
        self.e2e(env)
        self.long_benchmarks(env)
        baseline = json.loads(self.args.baseline.read_text()) if self.args.baseline else None
        md_path, _ = write_report(self.results, self.out, baseline)
        print(md_path.read_text(encoding="utf-8"))
        failed = [n for n, s in self.results["steps"].items() if s.get("status") in ("failed", "timeout")]
        return 1 if failed else 0


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


def make_rl_setup(root: Path) -> None:
    """The end-to-end runs' model (random Qwen2.5-0.5B shape, local tokenizer) and arithmetic prompts."""
    from transformers import Qwen2Config

    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer(vocab_size=4096)
    cfg = Qwen2Config(vocab_size=len(tok), **E2E_SHAPE)
    build_tiny_model(str(root / "model"), cfg, seed=0, tokenizer=tok)
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(64, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-report")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier report.json: the change of every figure")
    ap.add_argument("--budget-min", type=float, default=25.0, help="the whole check's time budget, minutes")
    ap.add_argument("--only", nargs="*", default=[], help="run only these steps (names as in the report)")
    ap.add_argument("--make-rl-setup", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_rl_setup:
        make_rl_setup(args.make_rl_setup)
        return 0
    why = no_cuda_message()
    if why:
        print(f"make gpu-check: {why}", file=sys.stderr)
        return 2
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
