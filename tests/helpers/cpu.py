"""The CPU settings under which a run's float results are reproducible, and what besides them can change those."""

from pathlib import Path

#: Float results of a CPU run depend on which vector kernels torch, MKL and oneDNN pick for the machine's ISA
#: (AVX2 vs AVX-512 sum in different orders) and on the thread count; pinned here for the golden trace and the
#: bitwise resume checks. MKL's GEMMs take the conditional-numerical-reproducibility branch ``COMPATIBLE`` (SSE2):
#: on AMD processors MKL ignores every other branch (``AVX2``, ``AVX512``: measured, the same bits as unset), so
#: only ``COMPATIBLE`` runs the same code on AMD and Intel machines. torch's own kernels are pinned to AVX2.
PINNED_CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def cpu_platform() -> dict[str, str]:
    """What, besides the code and :data:`PINNED_CPU_ENV`, can change a CPU run's float results: the processor
    (vendor, family, model, the vector extensions present) and the torch build."""
    import platform

    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.pop("flags", "").split())
    info["vector_extensions"] = " ".join(f for f in ("avx2", "fma", "avx512f") if f in flags)
    info["machine"] = platform.machine()
    info["torch"] = torch.__version__
    return info


def half_engine_pins() -> dict[str, str]:
    """:data:`PINNED_CPU_ENV` for a run whose engines compute in bfloat16: without the oneDNN cap on a processor with
    AMX, which vLLM's half-precision CPU kernels then need (megatron_pacs/config/cpu_isa.py; the trainer refuses the
    cap there). Such runs check a refusal at a ~1e-2 drift, not bits."""
    import torch

    pins = dict(PINNED_CPU_ENV)
    if torch.cpu._is_amx_tile_supported():
        del pins["ONEDNN_MAX_CPU_ISA"]
    return pins
