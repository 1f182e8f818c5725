"""Megatron parity on real gloo groups.

HF vs Megatron logits and sequence log-probs at TP=1, TP=2, PP=2, TP=2 x PP=2 and interleaved PP=2 x VPP=2, for
Qwen2 (tied and untied), Llama-3 (rope scaling) and Qwen3 (qk-norm); the SDPA attention spec; bitwise weight
export; vocab-parallel log-probs and their gradient; packed vs padded micro-batches (log-probs, gradients,
independence of packed neighbours) on the local and SDPA specs; two models in one forward-only schedule; a TP=2
checkpoint loaded at TP=1.

Each layout is one torchrun launch running every check (start-up dominates); see dist_checks.py.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
from megatron_pacs.utils.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).parent
# (TP, PP, VPP). TP=2 runs first: it writes the checkpoint the TP=1 run reshards.
LAYOUTS = [(2, 1, None), (1, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
MODELS = {
    "qwen2_tied": ("qwen2", True),
    "qwen2_untied": ("qwen2", False),
    "llama": ("llama", False),
    "qwen3_tied": ("qwen3", True),
    "qwen3_untied": ("qwen3", False),  # Qwen3-8B's layout (qk-norm, separate output layer)
}
FP32_TOL = 1e-5


def _launch(work: Path, tp: int, pp: int, vpp: int | None) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp * pp}"]
    cmd = [
        *launcher,
        f"--master-port={free_port()}",
        str(HERE / "dist_checks.py"),
        "--workdir",
        str(work),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        *(["--vpp", str(vpp)] if vpp else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"TP={tp} PP={pp} VPP={vpp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    suffix = f"_vpp{vpp}" if vpp else ""
    return json.loads((work / f"results_tp{tp}_pp{pp}{suffix}.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every layout's checks, two launches at a time; TP=1 waits for TP=2, whose checkpoint it reshards."""
    work = tmp_path_factory.mktemp("mcore_dist")
    for name, (family, tied) in MODELS.items():
        build_tiny_model(str(work / "models" / name), tiny_hf_config(family, tied=tied, layers=4), seed=1, scale=3.0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {layout: pool.submit(_launch, work, *layout) for layout in LAYOUTS if layout != (1, 1, None)}
        first = futures[(2, 1, None)]
        # TP=1 reshards TP=2's checkpoint: queued last, it starts long after TP=2 (the first launch) has finished
        futures[(1, 1, None)] = pool.submit(lambda: (first.result(), _launch(work, 1, 1, None))[1])
        return {layout: futures[layout].result() for layout in LAYOUTS}


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
