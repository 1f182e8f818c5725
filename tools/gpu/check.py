#!/usr/bin/env python3
"""``make gpu-check``: verify the GPU path on a machine with one or more CUDA GPUs, in one command, in two tiers.

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

``--tier full`` (the default; 25 minutes on one H100) runs the trainer tier's steps and then the rest: the 1.5B step
with TE; three PACS steps end to end with a real vLLM CUDA engine (colocated with sleep/wake, CUDA-IPC sync and
optimizer offload, with the GPU memory timeline; the NCCL broadcast to an engine on its own GPU with two or more
GPUs; an FP8 trainer); the 7B TE bf16 vs FP8 fwd+bwd, the FP8 score drift and TE's fp32 diagnosis.

Every step runs in its own process under a time limit derived from the README's H100 baseline (see ``LIMITS``),
within the tier's budget (``--budget-min``); a step the remaining budget no longer allows is skipped with that
reason, and every result is written to ``OUT/results.json`` as it finishes, so a run cut short keeps what completed.
Then ``OUT/report.md`` and ``OUT/report.json`` (tools/gpu/report.py): the figures beside their targets, every test,
and every step that could not run with its reason. ``--baseline old/report.json`` adds the change of every figure.
Without CUDA it says so and exits 2.

Usage: python tools/gpu_check.py [--tier trainer|full] [--out gpu-report] [--baseline old/report.json]
       [--budget-min M] [--only STEP ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from gpu.machine import MemoryTimeline, environment, junit_results  # noqa: E402 - importable from any directory
from gpu.report import write_report  # noqa: E402

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
# Three PACS steps without the fleet: the reference policy, reset at step 2, and a KL term (trainer tier).
SYNTHETIC_FLAGS = [
    "--rollout-source",
    "synthetic",
    "--train-iters",
    "3",
    "--global-batch-size",
    "8",
    "--group-size",
    "8",
    "--ppo-mini-batch-size",
    "4",
    "--max-prompt-length",
    "256",
    "--max-response-length",
    "1024",
    "--bf16",
    "--pacs-score-reference",
    "ref",
    "--ref-reset-interval",
    "2",
    "--kl-coef",
    "0.01",
    # resume == continuous is checked bit for bit: attention's default backward on CUDA sums with atomics
    "--deterministic-mode",
]
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


# Each step's time limit (seconds) on one H100, from the README's H100 baseline (shared/gpu figures: a 1.5B
# fwd+bwd 0.17-0.28 s, a full train step 0.25-0.38 s, a 7B fwd+bwd 0.31-0.42 s, a PACS step through the project
# 1.8 s, the 1.5B weight export 0.26 s) plus what the baseline does not count: a process's start (CUDA context,
# imports of torch, megatron-core and transformers: about 20 s), building a random model on the GPU (1.5B: about
# 15 s; 7B: about 60 s) and the HF reference's load. The limit is about 2x that estimate.
LIMITS = {
    # pytest start (~20 s) and one CUDA process per distributed test (~20 s each, ~5 of them without TE/vLLM)
    "gpu_tests": 240,
    # 4 implementations x 13 timed passes of <= 20 ms, one process: start-up bound (~30 s)
    "bench_logprobs": 90,
    # 3 variants x 2 layouts in one process each (~20 s start + 15 s model + (1 + 3) x 0.4 s): ~6 x 37 s = 220 s
    "train_step_1.5b": 420,
    # (full tier) the TE train step: 2 layouts x (20 s + 15 s + 6 x 0.3 s)
    "train_step_1.5b_te": 180,
    # a 0.5B model built once (~30 s); a 3-step synthetic run: start 30 s, 3 x (0.6 s step + 3 s checkpoint)
    "rl_setup": 120,
    "rl_synthetic": 180,
    "rl_synthetic_resumed": 120,
    # (full tier) an end-to-end run with a vLLM CUDA engine: engine start (~60-90 s) + trainer + 3 steps
    "rl_e2e": 300,
    # (full tier) the 7B model on the GPU (~60 s), 3 FP8 recipes + bf16 x (1 + 3) x 0.4 s, per process ~90 s
    "train_step_7b_fp8": 480,
    "bench_fp8_drift": 240,
    "diag_te_fp32": 90,
}
TIER_BUDGET_MIN = {"trainer": 6.5, "full": 25.0}


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
        # 4 prompts x 8 responses, one padded row (or its worst-case tokens packed) per micro-batch: the first
        # H100 run of the default (8 prompts, 2 rows) failed in every variant, its exception hidden by NCCL's exit
        # warning; the same bench at 4 prompts ran fwd+bwd within 49 GiB, and the train variant adds ~27 GiB of
        # optimizer state on one GPU.
        sized = ["--variants", "hf", "train", "--prompts", "4", "--micro-batch-size", "1", "--warmup", "1"]
        sized += ["--iters", "3"]
        self.run("train_step_1.5b_no_te", [*ts, "--impl", "sdpa", *sized], LIMITS["train_step_1.5b"])
        if self.args.tier == "trainer":
            return
        if env.get("transformer-engine") is not None:
            self.run("train_step_1.5b_te", [*ts, "--impl", "te", "--variants", "train"], LIMITS["train_step_1.5b_te"])
        else:
            self.skip("train_step_1.5b_te", "Transformer Engine is not installed")

    def rl_synthetic(self) -> None:
        """Three PACS steps through the CLI without the fleet (``--rollout-source synthetic``), with the reference
        and a reset, a checkpoint every step, and a resume from step 2 that must equal the continuous run."""
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
        load = ["--load", str(ckpt / "iter_0000002"), "--save", str(resumed), "--save-hf"]
        step = self._rl("rl_synthetic_resumed", [*base, *load], LIMITS["rl_synthetic_resumed"])
        if step and step.get("status") == "ok":
            comparison = _resume_comparison(
                self.results["steps"].get("rl_synthetic", {}), step, ckpt / "iter_0000003", resumed / "iter_0000003"
            )
            step["resume_equals_continuous"] = comparison["equal"]
            step["resume_comparison"] = comparison
            self.save()

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
                    LIMITS["train_step_7b_fp8"],
                )
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

    def _rl(self, name: str, cmd: list[str], limit_s: float = LIMITS["rl_e2e"]) -> dict:
        log_dir = self.out / "work" / name
        with MemoryTimeline() as timeline:
            step = self.run(name, [*cmd, "--log-dir", str(log_dir)], limit_s)
        if not step:
            return step
        metrics_file = log_dir / "metrics.jsonl"
        if metrics_file.exists():
            step["metrics"] = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        step["memory"] = timeline.summary()
        self.save()
        return step

    def main(self) -> int:
        self.t0 = time.time()
        env = self.results["environment"] = environment()
        self.save()
        self.rl_synthetic()
        self.gpu_tests()
        self.benchmarks(env)
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
    ap.add_argument("--tier", choices=sorted(TIER_BUDGET_MIN), default="full", help="trainer: no TE/vLLM/Ray needed")
    ap.add_argument("--budget-min", type=float, default=None, help="the time budget, minutes (trainer 6.5, full 25)")
    ap.add_argument("--only", nargs="*", default=[], help="run only these steps (names as in the report)")
    ap.add_argument("--make-rl-setup", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
