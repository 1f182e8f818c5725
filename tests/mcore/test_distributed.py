"""Megatron parity on real gloo groups.

HF vs Megatron logits and sequence log-probs at TP=1, TP=2, PP=2, TP=2 x PP=2 and interleaved PP=2 x VPP=2, for
Qwen2 (tied and untied), Llama-3 (rope scaling) and Qwen3 (qk-norm); the SDPA attention spec; bitwise weight
export; vocab-parallel log-probs and their gradient; packed vs padded micro-batches (log-probs, gradients,
independence of packed neighbours) on the local and SDPA specs; two models in one forward-only schedule; a TP=2
checkpoint loaded at TP=1.

Start-up dominates a launch, so layouts of the same world size share one torchrun launch (dist_checks.py runs
them one after another): four torchruns, one after another in one launch of the session's queue
(tests/launch_queue.py), which runs it beside the in-process tests.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from launch_queue import run_launch

from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
from megatron_pacs.utils.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).parent
Layout = tuple[int, int, int | None]  # (TP, PP, VPP)
LAYOUTS: list[Layout] = [(2, 1, None), (1, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
#: The launches, each a world of its own size running its layouts in order (the pipelines' two: one start-up, and
#: their ranks wait on each other, so that together they take no longer than TP=2, which writes the checkpoint that
#: the TP=1 launch reshards, then TP=1).
TORCHRUNS: list[list[Layout]] = [[(2, 1, None)], [(1, 2, None), (1, 2, 2)], [(2, 2, None)], [(1, 1, None)]]
assert sorted((layout for launch in TORCHRUNS for layout in launch), key=str) == sorted(LAYOUTS, key=str)
MODELS = {
    "qwen2_tied": ("qwen2", True),
    "qwen2_untied": ("qwen2", False),
    "llama": ("llama", False),
    "qwen3_tied": ("qwen3", True),
    "qwen3_untied": ("qwen3", False),  # Qwen3-8B's layout (qk-norm, separate output layer)
}
FP32_TOL = 1e-5


def _launch(work: Path, layouts: list[Layout]) -> dict[Layout, dict]:
    """One launch of TP x PP ranks running every check at each of ``layouts`` (all of one world size)."""
    (tp, pp, _), *_ = layouts
    # a world of one is a plain process (init_parallel's private store): no launcher to start
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={tp * pp}", f"--master-port={free_port()}"]
    specs = [f"--layout={tp},{pp}" + (f",{vpp}" if vpp else "") for tp, pp, vpp in layouts]
    script = [str(HERE / "dist_checks.py"), "--workdir", str(work), *specs]
    cmd = [sys.executable, *(launcher if tp * pp > 1 else []), *script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_launch(cmd, timeout=900, env=env)
    assert proc.returncode == 0, f"{specs} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {
        (tp, pp, vpp): json.loads((work / f"results_tp{tp}_pp{pp}{f'_vpp{vpp}' if vpp else ''}.json").read_text())
        for tp, pp, vpp in layouts
    }


def prepare(root: Path) -> Path:
    """The tiny models of every family, under ``root/models``."""
    for name, (family, tied) in MODELS.items():
        build_tiny_model(str(root / "models" / name), tiny_hf_config(family, tied=tied, layers=4), seed=1, scale=3.0)
    return root


def _torchruns(work: Path) -> dict[Layout, dict]:
    """Every layout's checks, one launch after another: TP=2 first (it writes the checkpoint that the TP=1 launch
    reshards), TP=1 last."""
    first, *others, reshard = TORCHRUNS
    assert first[0] == (2, 1, None) and reshard == [(1, 1, None)]
    return {layout: r for launch in (first, *others, reshard) for layout, r in _launch(work, launch).items()}


# queued for the session (tests/launch_queue.py): off the in-process tests' path, beside the other launches
LAUNCHES = {"torchruns": _torchruns}


@pytest.fixture(scope="module")
def results(launched) -> dict[Layout, dict]:
    return launched["torchruns"].result()


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_logits_and_sequence_logprobs_match_hf(results, layout, model):
    r = results[layout]
    assert r[f"logits/{model}"] < FP32_TOL
    assert r[f"seq_logp/{model}"] < FP32_TOL * 10  # sums of ~12 token log-probs
    assert r[f"export_bitwise/{model}"] is True


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_sdpa_attention_spec_matches_hf(results, layout):
    """The spec GPU runs use without Transformer Engine; SDPA also runs on CPU (its math backend here)."""
    assert results[layout]["logits_sdpa/qwen2_untied"] < FP32_TOL


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_vocab_parallel_logprobs_and_gradients(results, layout):
    r = results[layout]
    assert r["vocab_logprobs/value"] < 1e-12
    assert r["vocab_logprobs/entropy"] < 1e-12
    assert r["vocab_logprobs/grad"] < 1e-12


@pytest.mark.parametrize("spec", ["local", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_packed_and_padded_micro_batches_agree(results, layout, spec):
    """The same per-sequence log-probs (fp32 CPU <= 1e-5) and gradients whether sequences are padded rows or one
    packed row (thd: RoPE restarts, attention confined), at every layout; and changing one packed neighbour's
    tokens leaves the other sequences' log-probs exactly unchanged."""
    r = {k.split("/", 1)[1]: v for k, v in results[layout].items() if k.startswith(f"packing_{spec}/")}
    assert r["seq_logp"] <= 1e-5
    assert r["grad"] <= 1e-5 * max(1.0, r["grad_scale"])
    assert r["neighbour_moved_self"] > 1e-3  # the change is real
    assert r["neighbour_moved_others"] == 0.0


@pytest.mark.parametrize("spec", ["local", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_two_models_in_one_schedule_equal_each_alone(results, layout, spec):
    """The actor and the reference in one forward-only schedule (stacked along the batch dimension between
    pipeline stages) give each model's token log-probs bit for bit as their own schedules do, padded and packed."""
    r = results[layout]
    for micro_batches in ("padded", "packed"):
        assert r[f"together_{spec}_{micro_batches}/identical"] is True
        assert r[f"together_{spec}_{micro_batches}/models_differ"] > 1e-3  # two different models really ran


def test_checkpoint_saved_at_tp2_loads_at_tp1(results):
    assert results[(1, 1, None)]["ckpt_tp2_to_tp1/logits"] < FP32_TOL
