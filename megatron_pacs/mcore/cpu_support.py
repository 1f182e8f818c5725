"""Run Megatron-Core on a CPU-only torch build (gloo), for tests and the tiny CPU demo.

Megatron-Core assumes CUDA in a few dozen places. Each shim below names what it fixes; all are applied by
:func:`apply_cpu_support`, which does nothing when CUDA is available, so GPU runs never see them. No file of
megatron.core is edited. Verified on megatron-core 0.16.1 and 0.19.2 (see the project notes on the CPU stack).

1. ``torch.cuda.current_device`` returns the CPU device (RoPE buffers, TP all-gather buffers, p2p shapes).
2. The CUDA RNG calls map to the CPU generator, so Megatron's RNG tracker and activation recompute work.
3. ``torch.cuda`` streams, events and synchronize become no-ops (DDP grad sync, p2p, checkpointing).
4. megatron-core 0.16.1: ``moe_utils.te_general_gemm`` is defined (its absence is a NameError without TE).
5. MoE's all-to-all dispatcher: its split sizes become host arrays only for CUDA tensors
   (``maybe_move_tensor_to_cpu``), and gloo's ``all_to_all_single`` refuses tensors there; on CPU the same host
   arrays are made from the CPU tensors.
6. :func:`cuda_to_cpu` is a ``TorchFunctionMode`` that rewrites ``device="cuda"`` allocations to CPU; wrap the
   schedule, optimizer and checkpoint calls in it (the schedules allocate ``torch.zeros(..., device="cuda")``).

Callers also pass an explicit causal mask (the default one is built on "cuda") and set ``batch_p2p_sync=False``
and ``clip_grad=0.0`` (the Megatron optimizer's clip asserts CUDA tensor types) on CPU.

Importing this module on CPU also imports megatron.core itself, with ``torch.compile`` deferred to first calls
(:func:`_import_megatron_core`: about 1.5 s less per process), and silences, by exact message, the warnings
megatron-core raises at import about Transformer Engine and Apex being absent (:data:`HARMLESS_ON_CPU`): both are
CUDA-only, so on CPU the fallbacks are the only implementations. On GPU they stay, since there a missing TE or Apex
is real information. The filters only act if this module is imported before megatron.core.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HARMLESS_ON_CPU", "apply_cpu_support", "cpu_support_active", "cuda_to_cpu", "silence_harmless_cpu_warnings"]

_applied = False

HARMLESS_ON_CPU: tuple[tuple[str, str], ...] = (
    (
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "both are CUDA-only; torch.optim's optimizers are the only ones on CPU",
    ),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier and multi_tensor_scale",
        "the fused multi-tensor kernels are CUDA-only; the local loops are exact",
    ),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
        "the fused multi-tensor kernels are CUDA-only; the local loops are exact",
    ),
    (
        "Apex is not installed. Falling back to Torch Norm",
        "Apex's fused norm is CUDA-only, and the local spec swaps every norm for HFRMSNorm anyway",
    ),
)
"""``(exact message, why it is harmless on CPU)`` of the megatron-core import warnings that
:func:`silence_harmless_cpu_warnings` filters (UserWarning, megatron modules only)."""


def silence_harmless_cpu_warnings() -> bool:
    """Ignore :data:`HARMLESS_ON_CPU` (exact messages) when CUDA is absent; idempotent.

    Megatron-core warns once, at import, so this must run before megatron.core is first imported.

    Returns:
        True if the filters are installed (CPU), False on a CUDA machine (the warnings stay).
    """
    if torch.cuda.is_available():
        return False
    for message, _why in HARMLESS_ON_CPU:
        # megatron-core, and mbridge (which repeats Apex's norm message), warn from their own modules
        for module in ("megatron", "mbridge"):
            warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=UserWarning, module=module)
    return True


def cpu_support_active() -> bool:
    """True once the CPU shims are installed (never on a machine with CUDA)."""
    return _applied


def apply_cpu_support() -> bool:
    """Install the CPU shims when CUDA is absent; idempotent.

    Returns:
        True if the shims are active (CPU), False on a CUDA machine.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    silence_harmless_cpu_warnings()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits
    except ImportError:
        pass
    _applied = True
    return True


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``maybe_move_tensor_to_cpu`` on CPU tensors: the host array (``as_numpy``) the all-to-all takes as its split
    sizes, or the tensor itself."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _to_cpu(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")  # device=0 means cuda:0
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) if isinstance(a, str | torch.device) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Inside the block, hard-coded CUDA allocations land on the CPU; a no-op unless the CPU shims are active."""
    if not _applied:
        yield
        return
    with _CudaToCpuMode():
        yield


class _NoOpStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU, where every op is synchronous."""

    def __init__(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a, **k) -> _NoOpEvent:
        return _NoOpEvent()


class _NoOpEvent:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _compile_on_first_call(model: Callable | None = None, **options: Any) -> Any:
    """``torch.compile``'s decorator form, compiling at the decorated function's first call instead of at once."""
    if model is None:
        return lambda fn: _compile_on_first_call(fn, **options)
    compiled: Callable | None = None

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = _torch_compile(model, **options)
        return compiled(*args, **kwargs)

    return call


def _import_megatron_core() -> None:
    """Import megatron.core with ``torch.compile`` deferred to first calls (CPU only).

    ``megatron.core.jit`` binds ``jit_fuser = torch.compile`` at its import, and megatron's fused ops (bias-GeLU,
    SwiGLU, ...) are decorated with it as their modules load: the first decoration imports TorchInductor's compiler,
    about 1.5 s of every process's start. Bound to the deferred form here, ``jit_fuser`` stays deferred for every
    module megatron loads later; ``torch.compile`` itself is restored at once. On CPU those fusions are refused
    (mcore/model.py), so the deferred compile never comes; where a fused op is called anyway, it compiles then, as
    ``torch.compile`` would have (it also compiles at the first call).
    """
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    torch.compile = _compile_on_first_call  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _torch_compile


_torch_compile = torch.compile
silence_harmless_cpu_warnings()  # at import, so importing this module before megatron.core is enough
_import_megatron_core()
