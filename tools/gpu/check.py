#!/usr/bin/env python3
"""``make gpu-check``: verify the GPU path on a machine with one or more CUDA GPUs, in one command, in four tiers.

``--tier trainer`` (``make gpu-check TIER=trainer``; within 6.5 minutes on one H100, model creation included, so
that it fits the 7.5 minutes a short loan of a GPU machine leaves after installing megatron-core) needs only torch,
megatron-core, mbridge, transformers and the project: no Transformer Engine, vLLM, Ray or math-verify. It runs, most
telling first (a budget cut drops the tail):

1. the environment: GPUs, driver, torch/CUDA, and whichever of TE, vLLM, Megatron-Core and mbridge are installed;
2. three PACS steps through the CLI with ``--rollout-source synthetic`` on a random Qwen2.5-0.5B-shaped model, with
   the reference policy and a reset, a checkpoint every step, and a resume from step 2 that must equal the
   continuous run on the GPU; the step's time split and the weight export's time (``perf/time/sync``);
3. every ``gpu``-marked test (those needing TE, vLLM or Ray skip with their reason), among them CUDA-IPC weight
   handles (``sync.ipc_handle`` / ``rebuild_ipc``) between two processes on one GPU;
4. fused vs naive log-probs at V=151,936, T=4,096 (``bench_logprobs --device cuda``);
5. the 1.5B train step, packed vs padded vs HF (``bench_train_step --shape 1.5b``, MFU and peak memory), with
   fewer iterations to fit.

``--tier rollout`` (6.5 minutes after vLLM and Ray are installed; no TE) and ``--tier te`` (6.5 minutes after
Transformer Engine is; no vLLM or Ray) run the plans of tools/gpu/tiers.py (``PLANS``), most telling first. Rollout:
three PACS steps with a colocated vLLM CUDA engine (sleep/wake, CUDA-IPC sync, optimizer offload) on the random
0.5B shape, with the engine's start, the sync's time, generation tokens/s, the GPU memory timeline and engine vs
trainer log-probs (``consistency/*``, ``sync/max_logprob_diff``); three asynchronous PACS steps (two updates stale,
partial rollouts) with the engine beside the trainer on its GPU (object-store sync), with their staleness and
tokens/s; R3 from a real engine on a tiny Qwen3-MoE. TE: the 1.5B packed train step on
the TE spec in bf16 and FP8 (MFU, peak memory); three synthetic PACS steps with an FP8 trainer and bf16 score
passes; the same train step without TE; FP8's log-prob drift over 1k and 4k tokens against bf16.
``--engine-kwargs JSON`` (or ``GPU_CHECK_ENGINE_KWARGS``) reruns the engines with another engine argument.

``--tier full`` (the default; 25 minutes on one H100) runs the trainer tier's steps and then the rest: the 1.5B step
with TE; three PACS steps end to end with a real vLLM CUDA engine (colocated with sleep/wake, CUDA-IPC sync and
optimizer offload, with the GPU memory timeline; the NCCL broadcast to an engine on its own GPU with two or more
GPUs; an FP8 trainer); the 7B TE bf16 vs FP8 fwd+bwd, the FP8 score drift and TE's fp32 diagnosis.

Every step runs in its own process under a time limit derived from the README's H100 baseline (``LIMITS``),
within the tier's budget (``--budget-min``); a step the remaining budget no longer allows is skipped with that
reason, and every result is written to ``OUT/results.json`` as it finishes, so a run cut short keeps what completed.
Then ``OUT/report.md`` and ``OUT/report.json`` (tools/gpu/report.py): the figures beside their targets, every test,
and every step that could not run with its reason. ``--baseline old/report.json`` adds the change of every figure.
Without CUDA it says so and exits 2.

Usage: python tools/gpu_check.py [--tier full|rollout|te|trainer] [--out gpu-report] [--baseline old/report.json]
       [--budget-min M] [--only STEP ...] [--engine-kwargs JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from gpu.machine import (  # noqa: E402 - importable from any directory
    MemoryTimeline,
    environment,
    junit_results,
    no_cuda_message,
)
from gpu.report import write_report  # noqa: E402
from gpu.tiers import (  # noqa: E402
    ASYNC_FLAGS,
    COLOCATED_FLAGS,
    CRITIC_COMPARISON,
    DRIFT_ARGS,
    E2E_FLAGS,
    E2E_SHAPE,
    FP8_RL_FLAGS,
    LIMITS,
    MIN_START_S,
    PLANS,
    R3_TEST,
    SHARED_GPU_FLAGS,
    SYNTHETIC_FLAGS,
    TIER_BUDGET_MIN,
    TRAIN_STEP_SIZE,
    step_limit,
)

__all__ = ["E2E_SHAPE", "LIMITS", "PLANS", "SYNTHETIC_FLAGS", "TIER_BUDGET_MIN", "Check", "main"]

PY = sys.executable


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, args.out
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget_min * 60
        self.results: dict = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "tier": getattr(args, "tier", "full"),
            "steps": {},
        }
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        self.results["seconds"] = time.time() - self.t0
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n", encoding="utf-8")

    def skip(self, name: str, reason: str) -> None:
        self.results["steps"][name] = {"status": "skipped", "reason": reason, "seconds": 0.0}
        print(f"== {name}: skipped ({reason})", flush=True)
        self.save()

    def budget_cut(self, min_s: float = 30) -> str | None:
        """Why a step needing at least ``min_s`` seconds cannot start any more, or None when the budget allows it."""
        left = self.deadline - time.time()
        if left < 30:
            return f"the {self.args.budget_min}-minute budget is spent"
        if left < min_s:
            return f"the {self.args.budget_min}-minute budget leaves {left:.0f} s; the step needs about {min_s:.0f} s"
        return None

    def run(
        self, name: str, cmd: list[str], limit_s: float, min_s: float = 30, path: tuple[Path, ...] = (), **extra
    ) -> dict:
        """Run one step (a subprocess in the project root, with ``path`` on its PYTHONPATH too) within its limit and
        the overall budget; a step that needs more than ``min_s`` seconds of what is left is skipped with that
        reason."""
        if self.args.only and name not in self.args.only:
            return {}
        cut = self.budget_cut(min_s)
        if cut:
            self.skip(name, cut)
            return self.results["steps"][name]
        limit = min(limit_s, self.deadline - time.time())
        print(f"== {name}: {' '.join(cmd)} (limit {limit:.0f} s)", flush=True)
        started = time.time()
        pythonpath = os.pathsep.join([str(ROOT), *map(str, path), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=pythonpath)
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
            LIMITS["gpu_tests"],
        )
        if step and xml.exists():
            step["tests"] = junit_results(xml)
            if step["status"] == "failed" and all(t["status"] != "error" for t in step["tests"]):
                step["reason"] = f"{sum(t['status'] == 'failed' for t in step['tests'])} test(s) failed"
            self.save()

    def benchmarks(self, env: dict) -> None:
        """The log-prob kernels and the 1.5B train step (packed vs padded vs HF); the TE step in the full tier."""
        self.run("bench_logprobs", [PY, "benchmarks/bench_logprobs.py", "--device", "cuda"], LIMITS["bench_logprobs"])
        ts = [PY, "benchmarks/bench_train_step.py", "--shape", "1.5b", "--workdir", str(self.out / "work")]
        sized = ["--variants", "hf", "train", *TRAIN_STEP_SIZE]  # what fits one GPU (tiers.py)
        self.run("train_step_1.5b_no_te", [*ts, "--impl", "sdpa", *sized], LIMITS["train_step_1.5b"])
        if self.args.tier == "trainer":
            return
        if env.get("transformer-engine") is not None:
            self.run("train_step_1.5b_te", [*ts, "--impl", "te", "--variants", "train"], LIMITS["train_step_1.5b_te"])
        else:
            self.skip("train_step_1.5b_te", "Transformer Engine is not installed")

    def rl_synthetic(self) -> None:
        """Three PACS steps through the CLI without the fleet (``--rollout-source synthetic``), with the reference
        and a reset, a checkpoint every step, and a resume from step 1 with ``--async-save`` that must equal the
        continuous run; the saves' holds of the step, synchronous (the continuous run) and asynchronous (the
        resumed run's save of step 2), go into the report."""
        setup = self.out / "work" / "rl"
        if not (setup / "model" / "config.json").exists():
            prep = self.run(
                "rl_setup", [PY, str(Path(__file__).resolve()), "--make-rl-setup", str(setup)], LIMITS["rl_setup"]
            )
            if prep.get("status") != "ok":
                for name in ("rl_synthetic", "rl_synthetic_resumed"):
                    self.skip(name, "the model and data could not be prepared (rl_setup)")
                return
        ckpt = self.out / "work" / "rl_synthetic_ckpt"
        base = [PY, "-m", "megatron_pacs.train", "--hf-model", str(setup / "model")]
        base += ["--train-data", str(setup / "train.jsonl"), *SYNTHETIC_FLAGS]
        save = ["--save", str(ckpt), "--save-interval", "1", "--keep-last", "3", "--save-hf"]
        self._rl("rl_synthetic", [*base, *save], LIMITS["rl_synthetic"])
        resumed = self.out / "work" / "rl_synthetic_resumed_ckpt"
        load = ["--load", str(ckpt / "iter_0000001"), "--save", str(resumed), "--save-hf", "--async-save"]
        step = self._rl("rl_synthetic_resumed", [*base, *load], LIMITS["rl_synthetic_resumed"])
        if step and step.get("status") == "ok":
            comparison = _resume_comparison(
                self.results["steps"].get("rl_synthetic", {}), step, ckpt / "iter_0000003", resumed / "iter_0000003"
            )
            step["resume_equals_continuous"] = comparison["equal"]
            step["resume_comparison"] = comparison
            self.save()

    def critic_comparison(self) -> None:
        """(trainer tier, last) Three synthetic GRPO steps, then three PPO steps on the same shape and rollouts: what
        the critic costs in step time and GPU memory (docs/benchmarks.md has the CPU measurement)."""
        setup = self.out / "work" / "rl"
        if not (setup / "model" / "config.json").exists():
            for name in CRITIC_COMPARISON:
                self.skip(name, "the model and data could not be prepared (rl_setup)")
            return
        base = [PY, "-m", "megatron_pacs.train", "--hf-model", str(setup / "model")]
        base += ["--train-data", str(setup / "train.jsonl")]
        for name, flags in CRITIC_COMPARISON.items():
            self._rl(name, [*base, *flags], LIMITS[name], min_s=60)

    def long_benchmarks(self, env: dict) -> None:
        memory = env.get("gpu_memory_gib") or 0
        work = str(self.out / "work")
        if env.get("transformer-engine") is not None:
            if memory >= 70:
                cmd = [PY, "benchmarks/bench_train_step.py", "--shape", "7b", "--impl", "te", "--variants", "fwd_bwd"]
                cmd += ["--layouts", "padded", "--micro-batch-size", "1", "--fp8", "delayed", "tensorwise"]
                cmd += ["blockwise", "--iters", "3", "--workdir", work]
                self.run("train_step_7b_fp8", cmd, LIMITS["train_step_7b_fp8"])
            else:
                self.skip("train_step_7b_fp8", f"{memory} GiB of GPU memory; the 7B fwd+bwd needs about 70")
            self.run(
                "bench_fp8_drift",
                [PY, "benchmarks/bench_fp8_drift.py", "--workdir", work, "--sequences", "4"],
                LIMITS["bench_fp8_drift"],
            )
            self.run("diag_te_fp32", [PY, "benchmarks/diag_te_fp32.py"], LIMITS["diag_te_fp32"])
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
        prep = {"status": "ok"}
        if not (setup / "model" / "config.json").exists():
            prep = self.run(
                "rl_setup", [PY, str(Path(__file__).resolve()), "--make-rl-setup", str(setup)], LIMITS["rl_setup"]
            )
        if prep.get("status") != "ok":
            for name in names:
                self.skip(name, "the model and data could not be prepared (rl_setup)")
            return
        base = ["--hf-model", str(setup / "model"), "--train-data", str(setup / "train.jsonl"), *E2E_FLAGS]
        base += self.engine_flags()
        train = [PY, "-m", "megatron_pacs.train"]
        self._rl("rl_colocated", [*train, *base, *COLOCATED_FLAGS])
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

    def _rl(self, name: str, cmd: list[str], limit_s: float = LIMITS["rl_e2e"], min_s: float = 30) -> dict:
        log_dir = self.out / "work" / name
        with MemoryTimeline() as timeline:
            step = self.run(name, [*cmd, "--log-dir", str(log_dir)], limit_s, min_s)
        if not step or step["status"] == "skipped":
            return step
        metrics_file = log_dir / "metrics.jsonl"
        if metrics_file.exists():
            step["metrics"] = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        step["memory"] = timeline.summary()
        log = self.out / "logs" / f"{name}.log"
        started = re.search(r"engine\(s\) ready in ([0-9.]+) ?s", log.read_text()) if log.exists() else None
        if started:  # the fleet's own line: every engine up, from its first spawn
            step["engine_start_s"] = float(started.group(1))
        self.save()
        return step

    def engine_flags(self) -> list[str]:
        """``--rollout-engine-kwargs`` for every run with engines, from ``--engine-kwargs`` (or
        ``GPU_CHECK_ENGINE_KWARGS``): a rerun with another engine argument, e.g. ``{"enforce_eager": true}``."""
        extra = getattr(self.args, "engine_kwargs", None)
        return ["--rollout-engine-kwargs", extra] if extra else []

    # -- the rollout and TE tiers: a plan of steps (tiers.py) ---------------------------------------------------

    def run_plan(self, env: dict) -> None:
        """The tier's plan in order: each step runs unless the budget no longer fits it (``MIN_START_S``) or this
        machine lacks what it needs; either way it is recorded with the reason (a budget cut skips the tail)."""
        for name in PLANS[self.args.tier]:
            if self.args.only and name not in self.args.only:
                continue
            why = self.budget_cut(MIN_START_S[name]) or self.missing(name, env)
            if why:
                self.skip(name, why)
            elif name == "rl_setup":
                self.run(name, [PY, str(Path(__file__).resolve()), "--make-rl-setup", str(self.setup)], LIMITS[name])
            else:
                self._plan_step(name)

    @property
    def setup(self) -> Path:
        """The end-to-end runs' random 0.5B model and prompts (``rl_setup``)."""
        return self.out / "work" / "rl"

    def missing(self, name: str, env: dict) -> str | None:
        """What this machine lacks for step ``name`` (CUDA, vLLM and Ray, Transformer Engine, the prepared model),
        or None."""
        why = no_cuda_message()
        if why:
            return why
        if name in ("rl_colocated", "rl_async", "r3_routed_experts"):
            for dist, label in (("vllm", "vLLM"), ("ray", "Ray")):
                if not env.get(dist):
                    return f"{label} is not installed"
        if name in ("train_step_1.5b_te_fp8", "rl_fp8_synthetic", "fp8_drift"):
            if not (env.get("transformer-engine") or env.get("transformer-engine-torch")):
                return "Transformer Engine is not installed"
        if name == "rl_setup":
            return "already prepared" if (self.setup / "model" / "config.json").exists() else None
        if name in ("rl_colocated", "rl_async", "rl_fp8_synthetic"):
            if not (self.setup / "model" / "config.json").exists():
                return "the model and data could not be prepared (rl_setup)"
        return None

    def _plan_step(self, name: str) -> None:
        data = ["--hf-model", str(self.setup / "model"), "--train-data", str(self.setup / "train.jsonl")]
        train = [PY, "-m", "megatron_pacs.train", *data]
        work = str(self.out / "work")
        ts = [PY, "benchmarks/bench_train_step.py", "--shape", "1.5b", "--workdir", work, "--variants", "train"]
        ts += ["--layouts", "packed", *TRAIN_STEP_SIZE]
        limit, min_s = step_limit(name), MIN_START_S[name]
        if name == "rl_colocated":
            self._rl(name, [*train, *E2E_FLAGS, *self.engine_flags(), *COLOCATED_FLAGS], limit, min_s)
        elif name == "rl_async":
            self._rl(name, [*train, *E2E_FLAGS, *self.engine_flags(), *SHARED_GPU_FLAGS, *ASYNC_FLAGS], limit, min_s)
        elif name == "r3_routed_experts":
            self.routed_experts(limit, min_s)
        elif name == "train_step_1.5b_te_fp8":
            self.run(name, [*ts, "--impl", "te", "--fp8", "tensorwise"], limit, min_s)
        elif name == "train_step_1.5b_no_te_packed":
            self.run(name, [*ts, "--impl", "sdpa"], limit, min_s)
        elif name == "rl_fp8_synthetic":
            self._rl(name, [*train, *FP8_RL_FLAGS], limit, min_s)
        elif name == "fp8_drift":
            self.run(name, [PY, "benchmarks/bench_fp8_drift.py", "--workdir", work, *DRIFT_ARGS], limit, min_s)
        else:
            raise KeyError(name)

    def routed_experts(self, limit: float, min_s: float) -> None:
        """R3 from a real engine on a tiny Qwen3-MoE (the gpu test); skipped when the test skips itself."""
        xml = self.out / "r3.xml"
        # no conftest: it would queue the module's CPU parity launches beside this test (tests/ for its helpers)
        cmd = [PY, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={xml}", R3_TEST]
        step = self.run("r3_routed_experts", cmd, limit, min_s, path=(ROOT / "tests",))
        if step and xml.exists():
            step["tests"] = junit_results(xml)
            if step["status"] == "ok" and step["tests"] and all(t["status"] == "skipped" for t in step["tests"]):
                step.update(status="skipped", reason=step["tests"][0]["reason"])
            self.save()

    def main(self) -> int:
        env = self.results["environment"] = environment()
        self.save()
        if self.args.tier in PLANS:
            self.run_plan(env)
        else:
            self.rl_synthetic()
            self.gpu_tests()
            self.benchmarks(env)
            self.critic_comparison()
        if self.args.tier == "full":
            self.e2e(env)
            self.long_benchmarks(env)
        baseline = json.loads(self.args.baseline.read_text()) if self.args.baseline else None
        md_path, _ = write_report(self.results, self.out, baseline)
        print(md_path.read_text(encoding="utf-8"))
        failed = [n for n, s in self.results["steps"].items() if s.get("status") in ("failed", "timeout")]
        return 1 if failed else 0


def _resume_comparison(continuous: dict, resumed: dict, a: Path, b: Path) -> dict:
    """The resumed run's last step against the continuous run's: its metrics and its exported weights, bit for bit.

    Returns ``{"equal": bool, "metrics": {key: [continuous, resumed]}, "weights": str}``: every compared metric
    with both values, and the weights' verdict (``equal``, ``missing``, or the largest absolute difference), so a
    failure says whether it is a last-bit difference (a non-deterministic kernel) or a resume that lost state.
    """
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "ref/kl")
    last = [m for m in continuous.get("metrics", []) if "train/loss" in m][-1:]
    again = [m for m in resumed.get("metrics", []) if "train/loss" in m][-1:]
    out: dict = {"metrics": {}, "weights": "missing"}
    if last and again:
        out["metrics"] = {k: [last[0].get(k), again[0].get(k)] for k in keys}
    same_metrics = bool(out["metrics"]) and all(x == y for x, y in out["metrics"].values())
    files_a, files_b = sorted((a / "hf").glob("*.safetensors")), sorted((b / "hf").glob("*.safetensors"))
    if files_a and [f.name for f in files_a] == [f.name for f in files_b]:
        from safetensors.torch import load_file

        worst, names = 0.0, 0
        for fa, fb in zip(files_a, files_b, strict=True):
            ta, tb = load_file(fa), load_file(fb)
            names += len(ta)
            if ta.keys() != tb.keys():
                worst = float("inf")
                continue
            for name, t in ta.items():
                worst = max(worst, (t.double() - tb[name].double()).abs().max().item() if t.numel() else 0.0)
        out["weights"] = "equal" if worst == 0.0 else f"max abs diff {worst:.3g} over {names} tensors"
    out["equal"] = same_metrics and out["weights"] == "equal"
    return out


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
    ap.add_argument(
        "--tier",
        choices=sorted(TIER_BUDGET_MIN),
        default="full",
        help="trainer: no TE/vLLM/Ray needed; rollout: vLLM + Ray, no TE; te: TE, no vLLM/Ray; full: everything",
    )
    ap.add_argument(
        "--budget-min", type=float, default=None, help="the time budget, minutes (trainer, rollout, te 6.5; full 25)"
    )
    ap.add_argument("--only", nargs="*", default=[], help="run only these steps (names as in the report)")
    ap.add_argument(
        "--engine-kwargs",
        default=os.environ.get("GPU_CHECK_ENGINE_KWARGS") or None,
        metavar="JSON",
        help="--rollout-engine-kwargs for every run with engines, e.g. '{\"enforce_eager\": true}' (default: "
        "$GPU_CHECK_ENGINE_KWARGS, so that a bundle's rerun can pass it)",
    )
    ap.add_argument("--make-rl-setup", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_kwargs is not None:
        try:
            extra = json.loads(args.engine_kwargs)
        except json.JSONDecodeError as exc:
            ap.error(f"--engine-kwargs: {args.engine_kwargs!r} is not valid JSON ({exc.msg})")
        if not isinstance(extra, dict):
            ap.error(f"--engine-kwargs: {args.engine_kwargs!r} is not a JSON object")
    if args.budget_min is None:
        args.budget_min = TIER_BUDGET_MIN[args.tier]
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
