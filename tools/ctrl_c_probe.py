"""Ctrl-C at random points of an ``--async-save`` run: it must end within the heartbeat timeout with one line, and
the resume must be bit for bit the uninterrupted run (issue 53).

    python tools/ctrl_c_probe.py --out runs/ctrl_c_probe --trials 50 [--seed 0]

In ``--out`` it builds a tiny model (the demo's tokenizer, a random Qwen2) and 8 problems, and runs the uninterrupted
reference once: 3 PACS steps on synthetic rollouts (no fleet), a background save every step. Each trial runs the same
command in a session of its own and sends SIGINT to its whole process group, as a terminal's Ctrl-C does (the
forked checkpoint writers get it too), at a random point: half the trials a random 0-0.4 s after a save's writer
has forked (the window the issue's hangs came from), the others anywhere in the run. It then checks that the run
exited 130 (0 when it had finished), within :data:`BOUND_S` of the signal, with the interruption's line last and no
traceback, and resumes it (``--load`` = ``--save``) to the last step: each resumed step's losses, gradient norm and
rewards, and the last checkpoint's fingerprints, must equal the reference's. One JSON line per trial goes to
``OUT/trials.jsonl`` and a summary to stdout.

tests/test_async_save.py runs two fixed points of this (its ``ctrl_c`` launch); this script is run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BOUND_S = 60.0
"""The heartbeat timeout's default: a stopped run must end before its peers would declare it lost."""

PINNED_CPU_ENV = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
"""The suite's CPU pins (tests/helpers/cpu.py): the reference and the resumes compare bit for bit."""

FLAGS = [
    "--rollout-source",
    "synthetic",
    "--synthetic-reward-rate",
    "0.5",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "4",
    "--ppo-mini-batch-size",
    "2",
    "--group-size",
    "4",
    "--max-response-length",
    "12",
    "--max-prompt-length",
    "96",
    "--lr",
    "1e-3",
    "--train-iters",
    "3",
    "--save-interval",
    "1",
    "--keep-last",
    "3",
    "--async-save",
]
"""The run interrupted: tests/test_async_save.py's, without the reference (a save of the actor alone)."""

KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean", "pacs/loss")


def prepare(root: Path) -> Path:
    """A tiny Qwen2 (head_dim 32) with the demo's tokenizer, and 8 problems, under ``root``."""
    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    if (root / "model" / "config.json").is_file():
        return root
    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=True)
    build_tiny_model(str(root / "model"), cfg, seed=0, tokenizer=tok, scale=3.0)
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(8, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return root


def command(root: Path, save: Path, log_dir: Path, *extra: str) -> list[str]:
    """``python -m megatron_pacs.train`` of the probed run."""
    model, data = str(root / "model"), str(root / "train.jsonl")
    base = [sys.executable, "-m", "megatron_pacs.train", "--hf-model", model, "--train-data", data, *FLAGS]
    return [*base, *extra, "--save", str(save), "--log-dir", str(log_dir)]


def environment() -> dict[str, str]:
    return dict(os.environ, **PINNED_CPU_ENV)


@dataclass
class Interrupted:
    """How an interrupted run ended."""

    code: int | None
    """Its exit status (None: it had not ended :data:`BOUND_S` after the signal, and was killed)."""
    seconds: float
    """From the signal to its end."""
    signalled_at: float
    """From its start to the signal."""
    during_write: bool
    """A checkpoint writer was running when the signal was sent."""
    last_line: str
    """Its stderr's last line."""
    clean: bool
    """No traceback, ``KeyboardInterrupt`` or ``ForkProcess`` in its stderr."""
    stderr: str


def _writers(pid: int) -> list[int]:
    """The forked checkpoint writers of process ``pid``: its children running its own command line."""
    import psutil

    try:
        parent = psutil.Process(pid)
        cmdline = parent.cmdline()
        return [c.pid for c in parent.children() if c.cmdline() == cmdline]
    except psutil.Error:
        return []


def interrupt(
    cmd: list[str],
    *,
    cwd: Path,
    stderr: Path,
    after_write: float | None,
    at: float = 0.0,
    env: dict[str, str] | None = None,
) -> Interrupted:
    """Run ``cmd`` in a session of its own and send SIGINT to its process group: ``after_write`` seconds after the
    first checkpoint writer forks (None: ``at`` seconds after the start). ``env``: default :func:`environment`."""
    started = time.monotonic()
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env or environment(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    try:
        if after_write is None:
            while proc.poll() is None and time.monotonic() < started + at:
                time.sleep(0.01)
        else:
            while proc.poll() is None and not _writers(proc.pid) and time.monotonic() < started + 600:
                time.sleep(0.005)
            time.sleep(after_write)
        signalled = time.monotonic()
        during = bool(_writers(proc.pid))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            code: int | None = proc.wait(timeout=BOUND_S + 30)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.monotonic()
    finally:
        if proc.poll() is None or code is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = stderr.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    clean = not any(word in text for word in ("Traceback", "KeyboardInterrupt", "ForkProcess"))
    return Interrupted(code, ended - signalled, signalled - started, during, lines[-1] if lines else "", clean, text)


def metrics(log_dir: Path) -> dict[int, dict[str, float]]:
    """The run's training steps' :data:`KEYS` by step (none when it logged none)."""
    path = log_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
    return {m["step"]: {k: m[k] for k in KEYS if k in m} for m in rows if "train/loss" in m}


def fingerprints(save: Path, step: int = 3) -> str:
    return (save / f"iter_{step:07d}" / "fingerprint_rank00000.json").read_text()


def resume(root: Path, save: Path, log_dir: Path) -> subprocess.CompletedProcess[str]:
    """The interrupted run resumed to its last step (the same command, ``--load`` its ``--save``)."""
    cmd = command(root, save, log_dir, "--load", str(save))
    return subprocess.run(cmd, cwd=root, env=environment(), capture_output=True, text=True, timeout=900)


def judge(result: Interrupted, expected_line: str = "interrupted by Ctrl-C (SIGINT); exiting 130") -> list[str]:
    """What is wrong with how an interrupted run ended (empty: nothing)."""
    wrong = []
    if result.code is None:
        wrong.append(f"still running {BOUND_S + 30:.0f}s after the signal (killed)")
    elif result.code not in (0, 130):
        wrong.append(f"exit status {result.code}")
    elif result.code == 130 and result.last_line != expected_line:
        wrong.append(f"last line {result.last_line!r}")
    if result.code is not None and result.seconds > BOUND_S:
        wrong.append(f"ended {result.seconds:.1f}s after the signal (> {BOUND_S:.0f}s)")
    if not result.clean:
        wrong.append("a traceback in stderr")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Work folder (model, runs, trials.jsonl).")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = prepare(args.out.resolve())
    reference = root / "reference"
    if not (reference / "ckpt" / "iter_0000003").is_dir():
        shutil.rmtree(reference, ignore_errors=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            command(root, reference / "ckpt", reference / "logs"), cwd=root, env=environment(), capture_output=True
        )
        if proc.returncode:
            print(proc.stderr.decode()[-3000:], file=sys.stderr)
            return 1
        (reference / "seconds.txt").write_text(f"{time.monotonic() - t0:.1f}\n")
    # "anywhere in the run": uniform over the reference run's wall time
    span = float((reference / "seconds.txt").read_text()) if (reference / "seconds.txt").is_file() else 15.0
    ref_metrics, ref_prints = metrics(reference / "logs"), fingerprints(reference / "ckpt")
    whole = time.monotonic()
    rng, failures = random.Random(args.seed), 0
    with open(root / "trials.jsonl", "a") as out:
        for trial in range(args.trials):
            folder = root / f"trial_{args.seed}_{trial:03d}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            save, logs = folder / "ckpt", folder / "logs"
            after = rng.uniform(0.0, 0.4) if trial % 2 == 0 else None
            at = rng.uniform(0.5, span)
            result = interrupt(
                command(root, save, logs), cwd=root, stderr=folder / "stderr.txt", after_write=after, at=at
            )
            wrong = judge(result)
            resumed_equal = None
            if result.code is not None and not wrong:
                again = resume(root, save, folder / "resumed")
                if again.returncode:
                    wrong.append(f"the resume failed: {again.stderr[-500:]!r}")
                else:
                    done = {**metrics(logs), **metrics(folder / "resumed")}
                    resumed_equal = done == ref_metrics and fingerprints(save) == ref_prints
                    if not resumed_equal:
                        wrong.append("the resumed run differs from the uninterrupted one")
            failures += bool(wrong)
            row = {**asdict(result), "trial": trial, "after_write": after, "at": None if after is not None else at}
            row.update(wrong=wrong, resumed_equal=resumed_equal)
            row.pop("stderr")
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(
                f"trial {trial}: exit {result.code} {result.seconds:.1f}s after the signal "
                f"({'during a write' if result.during_write else 'no write'}); "
                f"{'; '.join(wrong) if wrong else 'ok'}",
                flush=True,
            )
            if not wrong:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.trials - failures} of {args.trials} trials held ({time.monotonic() - whole:.0f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
