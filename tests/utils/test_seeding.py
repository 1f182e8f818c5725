"""utils.seeding: streams derived from (seed, domain, keys) are independent; addition-derived seeds alias."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_pacs.config import parse_config
from megatron_pacs.utils.seeding import (
    DETERMINISTIC_ENV,
    LOADER_STREAM,
    SAMPLING_STREAM,
    derive_seed,
    seed_sequence,
)


def _windows_overlap(bases: dict, width: int) -> list:
    """Pairs of streams whose per-call seed windows ``[base, base + width)`` intersect (vLLM seeds sample j of
    prompt i with ``base + i * n + j``, so a call uses every integer in its window)."""
    ordered = sorted(bases.items(), key=lambda kv: kv[1])
    return [(a, b) for (a, x), (b, y) in itertools.pairwise(ordered) if y - x < width]


def test_rollout_seed_windows_of_a_seed_sweep_never_overlap():
    """Seeds 0-9 x 1000 steps with 512 prompts x 16 samples per step: no two steps share a per-sample seed. The
    old ``seed * 1_000_003 + step * 7919`` fails this (seed s at step ~126 runs into seed s+1's step 0)."""
    width = 512 * 16
    bases = {(s, t): derive_seed(s, SAMPLING_STREAM, t) for s in range(10) for t in range(1000)}
    assert _windows_overlap(bases, width) == []
    assert all(0 <= b < 2**62 for b in bases.values())  # + i * n + j stays inside vLLM's int64 seed tensor
    old = {(s, t): s * 1_000_003 + t * 7919 for s in range(10) for t in range(1000)}
    assert _windows_overlap(old, width), "the additive derivation should alias (the defect this test pins)"


def test_domains_and_keys_give_distinct_streams():
    seen = {derive_seed(s, d, k) for s in range(5) for d in (LOADER_STREAM, SAMPLING_STREAM) for k in range(20)}
    assert len(seen) == 5 * 2 * 20
    assert derive_seed(3, SAMPLING_STREAM, 7) == derive_seed(3, SAMPLING_STREAM, 7)  # deterministic


def test_stream_is_numpys_seed_sequence():
    ss = seed_sequence(4, LOADER_STREAM, 2)
    assert (ss.entropy, ss.spawn_key) == (4, (LOADER_STREAM, 2))
    a = np.random.default_rng(ss).permutation(10)
    assert list(a) == list(np.random.default_rng(np.random.SeedSequence(4, spawn_key=(0, 2))).permutation(10))


def test_negative_seed_is_refused_with_the_flag():
    with pytest.raises(ValueError, match="--seed -1"):
        derive_seed(-1, SAMPLING_STREAM, 0)


def test_deterministic_mode_turns_on_deterministic_kernels_and_keeps_the_launchs_settings():
    """``--deterministic-mode`` in a fresh process: torch's deterministic algorithms on, cuBLAS's workspace and
    NCCL's algorithm set where the launch did not set them, a launch's own value kept (the whole run with the flag:
    tests/sources/test_synthetic_run.py)."""
    code = (
        "import json, os, torch\n"
        "from megatron_pacs.utils.seeding import use_deterministic_kernels\n"
        "added = use_deterministic_kernels()\n"
        "print(json.dumps([added, torch.are_deterministic_algorithms_enabled(), os.environ['NCCL_ALGO']]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in DETERMINISTIC_ENV}
    env["NCCL_ALGO"] = "Tree"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    added, enabled, algo = json.loads(out.stdout.splitlines()[-1])
    assert added == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert enabled and algo == "Tree"
    cfg = parse_config(["--hf-model", "m", "--train-data", "d", "--deterministic-mode"])
    assert cfg.model.deterministic_mode
    assert not parse_config(["--hf-model", "m", "--train-data", "d"]).model.deterministic_mode
