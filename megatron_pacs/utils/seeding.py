"""Independent random streams derived from the run's ``--seed``.

Deriving a stream by addition (``seed + epoch``, ``seed * a + step * b``) aliases streams across seeds: seed s at
epoch 1 is seed s+1 at epoch 0, so a seed sweep replays shifted copies of one data order. Every stream is instead
``numpy.random.SeedSequence(seed, spawn_key=(domain, *keys))``, which hashes all of its inputs.
"""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = [
    "DETERMINISTIC_ENV",
    "LOADER_STREAM",
    "SAMPLING_STREAM",
    "STREAM_SAMPLING_STREAM",
    "SYNTHETIC_STREAM",
    "derive_seed",
    "seed_sequence",
    "use_deterministic_kernels",
]

LOADER_STREAM = 0
"""Domain of the prompt loader's per-epoch permutations: keys ``(epoch,)``."""
SAMPLING_STREAM = 1
"""Domain of the rollout sampling seeds: keys ``(step,)``."""
SYNTHETIC_STREAM = 2
"""Domain of the synthetic rollout source's lengths, tokens and rewards: keys ``(step,)``."""
STREAM_SAMPLING_STREAM = 3
"""Domain of the asynchronous stream's sampling seeds (``--max-staleness``): keys ``(round,)``."""

_SEED_BITS = 62
"""Derived seeds stay below 2**62, so ``seed + prompt * n + sample`` (vLLM adds the sample index) fits vLLM's int64
per-request seed tensor."""


def seed_sequence(seed: int, domain: int, *keys: int) -> np.random.SeedSequence:
    """The independent stream ``(seed, domain, *keys)``.

    Args:
        seed: The run's ``--seed`` (non-negative).
        domain: Which consumer (``LOADER_STREAM``, ``SAMPLING_STREAM``), so two consumers never share a stream.
        keys: Non-negative stream coordinates within the domain, e.g. the epoch.

    Returns:
        A ``SeedSequence`` for ``numpy.random.default_rng`` or ``derive_seed``.
    """
    if seed < 0:
        raise ValueError(f"--seed {seed}: use a non-negative integer")
    if any(k < 0 for k in (domain, *keys)):
        raise ValueError(f"stream keys {(domain, *keys)} must be non-negative")
    return np.random.SeedSequence(int(seed), spawn_key=(int(domain), *(int(k) for k in keys)))


def derive_seed(seed: int, domain: int, *keys: int) -> int:
    """An integer seed (``0 <= s < 2**62``) for the independent stream ``(seed, domain, *keys)``."""
    lo, hi = seed_sequence(seed, domain, *keys).generate_state(2, np.uint32)
    return ((int(hi) << 32) | int(lo)) & ((1 << _SEED_BITS) - 1)


DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
"""What ``--deterministic-mode`` sets in a rank's environment where the launch did not: cuBLAS's fixed workspace
(without it ``torch.use_deterministic_algorithms`` refuses a CUDA GEMM), one NCCL all-reduce algorithm (Megatron-LM
asks for one of Tree or Ring; NCCL otherwise picks per message size and topology, and sums in a different order) and
Transformer Engine's deterministic kernels (Megatron's TE attention refuses ``deterministic_mode`` without them)."""


def use_deterministic_kernels() -> dict[str, str]:
    """``--deterministic-mode``: from here on, this process runs deterministic kernels only.

    ``torch.use_deterministic_algorithms(True)``: an op without a deterministic form raises instead of running (e.g.
    attention's backward on CUDA then takes FlashAttention's deterministic path instead of accumulating dQ with
    atomics), plus ``DETERMINISTIC_ENV`` where unset. Call it before the process's first CUDA kernel and its process
    group. On the CPU the run's bits are already repeatable (tests/helpers/cpu.py pins the vector kernels).

    Returns:
        The environment variables it set (name -> value), for the log.
    """
    added = {k: v for k, v in DETERMINISTIC_ENV.items() if k not in os.environ}
    os.environ.update(added)
    torch.use_deterministic_algorithms(True)
    return added
