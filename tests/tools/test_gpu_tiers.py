"""The rollout and TE tiers of tools/gpu_check.py, without a GPU: each tier's plan (its steps in order, most telling
first), its budget and per-step limits, a budget cut skipping the tail with the reason, every GPU step skipping
cleanly without CUDA, the runs' flags being valid runs, ``--engine-kwargs``, and the report of each tier's figures
from recorded results (tests/tools/data/gpu_check_{rollout,te}_results.json: illustrative values, never measured).
"""

import argparse
import copy
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return _load("gpu_check", ROOT / "tools" / "gpu" / "check.py")


@pytest.fixture(scope="module")
def report():
    return _load("gpu_report", ROOT / "tools" / "gpu" / "report.py")


def _check(gpu_check, tmp_path, tier, budget_min=6.5, **extra):
    args = argparse.Namespace(out=tmp_path / "r", tier=tier, budget_min=budget_min, only=[], baseline=None, **extra)
    return gpu_check.Check(args)


def _by_name(figures):
    return {f["name"]: f for f in figures}


def test_each_tier_has_its_plan_in_order_and_help_offers_every_tier(gpu_check):
    """Most telling first; ``--help`` shows ``--tier {full,rollout,te,trainer}`` (the GPU bundles grep for it)."""
    assert gpu_check.PLANS["rollout"] == ("rl_setup", "rl_colocated", "rl_async", "r3_routed_experts")
    assert gpu_check.PLANS["te"] == (
        "train_step_1.5b_te_fp8",
        "rl_setup",
        "rl_fp8_synthetic",
        "train_step_1.5b_no_te_packed",
        "fp8_drift",
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "--tier {full,rollout,te,trainer}" in out and "--engine-kwargs JSON" in out


@pytest.mark.parametrize("tier", ["rollout", "te"])
def test_each_tiers_budget_and_step_limits_fit_one_short_loan(gpu_check, tier):
    """6.5 minutes after the stack is present; every step's limit fits the budget, its start threshold its limit,
    the most telling run fits its whole limit after the setup, and every step but the tail starts when the ones
    before it take their estimates (``MIN_START_S``). The tail is what the budget cut drops when they do: the TE
    tier's whole plan fits; the rollout tier's R3 (after the asynchronous run) does not at the present estimates,
    so R3 runs only when the runs before it finish sooner than estimated."""
    from gpu.tiers import MIN_START_S, step_limit

    budget_s = gpu_check.TIER_BUDGET_MIN[tier] * 60
    assert budget_s == 390
    for name in gpu_check.PLANS[tier]:
        assert 0 < MIN_START_S[name] <= step_limit(name) <= budget_s, name
    most_telling = next(n for n in gpu_check.PLANS[tier] if n != "rl_setup")
    assert step_limit(most_telling) + MIN_START_S["rl_setup"] <= budget_s  # its whole limit, after the setup
    *head, tail = gpu_check.PLANS[tier]
    assert sum(MIN_START_S[n] for n in head) <= budget_s  # every step but the tail starts
    if tier == "te":
        assert sum(MIN_START_S[n] for n in [*head, tail]) <= budget_s  # the tail too


@pytest.mark.parametrize("tier", ["rollout", "te"])
def test_without_cuda_every_gpu_step_skips_with_its_reason_in_plan_order(gpu_check, tier, tmp_path):
    """On this CPU machine: each step is recorded as it is passed (results.json), in the plan's order, skipped with
    the reason."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the steps would run")
    check = _check(gpu_check, tmp_path, tier)
    check.run_plan({"vllm": "0.32.0", "ray": "2.60.0", "transformer-engine": "2.20.2"})
    steps = json.loads((tmp_path / "r" / "results.json").read_text())["steps"]
    assert list(steps) == list(gpu_check.PLANS[tier])
    assert all(s["status"] == "skipped" for s in steps.values())
    for name, step in steps.items():
        assert "no CUDA GPU visible" in step["reason"], (name, step)


def test_a_budget_cut_skips_the_tail_with_the_reason(gpu_check, tmp_path):
    """100 s left: the setup still fits (and skips for want of CUDA); the runs that need more are cut, each with
    what is left and what it needs."""
    check = _check(gpu_check, tmp_path, "rollout")
    check.deadline = time.time() + 100
    check.run_plan({"vllm": "0.32.0", "ray": "2.60.0"})
    steps = check.results["steps"]
    assert "budget leaves" not in steps["rl_setup"]["reason"]
    assert "6.5-minute budget leaves" in steps["rl_colocated"]["reason"]
    assert steps["rl_colocated"]["reason"].endswith("the step needs about 150 s")
    assert "the step needs about 100 s" in steps["r3_routed_experts"]["reason"]
    check.deadline = 0.0
    assert check.budget_cut(30) == "the 6.5-minute budget is spent"


def test_the_runs_flags_are_valid_runs_with_engine_arguments(gpu_check, tmp_path):
    """The rollout tier's run (with an engine argument from ``--engine-kwargs``) and the TE tier's FP8 run are runs
    the train CLI accepts; ``--engine-kwargs`` must be a JSON object."""
    from gpu.tiers import COLOCATED_FLAGS, E2E_FLAGS, FP8_RL_FLAGS

    from megatron_pacs.config import parse_config

    check = _check(gpu_check, tmp_path, "rollout", engine_kwargs='{"enforce_eager": true}')
    data = ["--hf-model", "m", "--train-data", "d"]
    cfg = parse_config([*data, *E2E_FLAGS, *COLOCATED_FLAGS, *check.engine_flags()])
    assert cfg.rollout.colocate and cfg.rollout.rollout_engine_kwargs == {"enforce_eager": True}
    fp8 = parse_config([*data, *FP8_RL_FLAGS])
    assert fp8.model.fp8_format == "hybrid" and fp8.model.fp8_score_precision == "bf16"
    assert fp8.source.rollout_source == "synthetic"
    assert _check(gpu_check, tmp_path, "te").engine_flags() == []
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--tier", "rollout", "--engine-kwargs", "[1]"])
    assert info.value.code == 2


def test_the_async_run_is_a_valid_run_on_one_gpu_with_cuda_simulated(gpu_check, tmp_path, monkeypatch, capsys):
    """The rollout tier's asynchronous run (rl_async) passes every check of the train CLI, the machine's included
    (CUDA simulated: the check reads ``_cuda_available``, and this machine has none): the engine beside the trainer
    with an object-store sync and a share of the GPU's memory. Its colocated form is refused (colocated engines
    sleep while the actor trains), which is why the step is not colocated."""
    from gpu.tiers import ASYNC_FLAGS, COLOCATED_FLAGS, E2E_FLAGS, SHARED_GPU_FLAGS

    from megatron_pacs.config import parse_config
    from megatron_pacs.config import train as train_config

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    monkeypatch.setattr(train_config, "_cuda_available", lambda: True)
    cfg = parse_config([*files, *E2E_FLAGS, *SHARED_GPU_FLAGS, *ASYNC_FLAGS])
    cfg.validate(1)
    r = cfg.rollout
    assert (r.max_staleness, r.partial_rollouts, r.rollout_round_tokens) == (2, True, 32)
    assert not r.colocate and r.weight_sync == "object_store" and r.engine_memory_fraction == 0.35
    with pytest.raises(SystemExit):
        parse_config([*files, *E2E_FLAGS, *COLOCATED_FLAGS, *ASYNC_FLAGS])
    assert "colocated engines sleep then (--colocate)" in capsys.readouterr().err


def test_the_memory_timeline_keeps_the_trace_thinned(gpu_check):
    from gpu.machine import MemoryTimeline

    timeline = MemoryTimeline()
    timeline.samples = [(100.0 + t, [gib]) for t, gib in enumerate([1.0, 40.0, 60.0, 20.0, 61.0, 0.5] * 50)]
    summary = timeline.summary()
    assert summary["peak_gib"] == 61.0 and summary["freed_gib"]["drop 1"] == 40.0
    assert summary["timeline"][:2] == [[0.0, 1.0], [2.0, 60.0]] and len(summary["timeline"]) <= 150


def test_the_rollout_tiers_report_from_recorded_results(report, tmp_path):
    results = json.loads((DATA / "gpu_check_rollout_results.json").read_text())
    md_path, json_path = report.write_report(results, tmp_path)
    figs = _by_name(json.loads(json_path.read_text())["figures"])
    run = "RL colocated (ipc, sleep/wake, optimizer offload)"
    assert figs[f"{run}: engine start"]["value"] == pytest.approx(74.2)
    assert figs[f"{run}: perf/time/sync (last step)"]["value"] == pytest.approx(0.41)
    assert figs[f"{run}: generated tokens/s (last step)"]["value"] == pytest.approx(5120 * 120 / 160 / 2.5)
    worst = figs[f"{run}: engine vs trainer max abs(d logp), bf16 (worst step)"]
    assert worst["value"] == pytest.approx(0.42) and worst["ok"] is True  # the bf16 bound 1.0
    assert figs[f"{run}: engine vs trainer k3, bf16 (worst step)"]["value"] == pytest.approx(9.4e-4)
    assert figs[f"{run}: first mini-batch's abs(log ratio) per response, max (worst step)"]["value"] == 0.71
    memory = figs[f"{run}: GPU memory peak"]
    assert memory["value"] == 61.4 and "95 s 61.4" in memory["note"]
    assert figs[f"{run}: GPU memory freed by drop 1"]["value"] == pytest.approx(36.2)
    r3 = "R3: routed experts from a vLLM engine replayed by the trainer"
    assert figs[r3]["value"] is None and "budget leaves 35 s" in figs[r3]["note"]  # the tail the budget cut
    assert not any("1.5B" in name for name in figs)  # this tier's figures only
    text = md_path.read_text()
    assert "| r3_routed_experts | skipped | 0 | the 6.5-minute budget leaves 35 s; the step needs about 100 s |" in text

    stale = "RL async, 2 updates stale, partial rollouts"
    assert figs[f"{stale}: engine start"]["value"] == pytest.approx(61.5)
    assert figs[f"{stale}: sync/max_logprob_diff"]["value"] == pytest.approx(0.19)  # the probe after step 1
    behind = figs[f"{stale}: updates behind per token, max (worst step)"]
    assert behind["value"] == 2.0 and behind["target"] == "<= 2" and behind["ok"] is True
    assert figs[f"{stale}: responses spanning a weight update (worst step)"]["value"] == pytest.approx(0.75)
    assert figs[f"{stale}: perf/tokens_per_sec (last step)"]["value"] == pytest.approx(1530.0)
    assert figs[f"{stale}: perf/time/overlap_hidden (last step)"]["value"] == pytest.approx(2.1)
    assert figs[f"{stale}: GPU memory peak"]["value"] == pytest.approx(38.6)
    # stale rollouts: no engine vs trainer comparison under the same weights, and no engine-only generation time
    assert not any(name.startswith(stale) and ("d logp" in name or "generated tokens/s" in name) for name in figs)

    results["steps"]["rl_colocated"]["metrics"][1]["consistency/logprob_abs_diff_max"] = 1.7  # a missed sync
    results["steps"]["rl_async"]["metrics"][2]["rollout/staleness_token_max"] = 3.0  # past --max-staleness
    passed = {"id": "tests.mcore.test_router_replay::test_vllm", "status": "passed", "reason": ""}
    results["steps"]["r3_routed_experts"] = {"status": "ok", "reason": "", "seconds": 95.0, "tests": [passed]}
    figs = _by_name(report.figures(results))
    assert figs[f"{run}: engine vs trainer max abs(d logp), bf16 (worst step)"]["ok"] is False
    assert figs[f"{stale}: updates behind per token, max (worst step)"]["ok"] is False
    assert figs[r3]["ok"] is True
    results["steps"]["rl_async"] = {"status": "skipped", "reason": "vLLM is not installed", "seconds": 0.0}
    figs = _by_name(report.figures(results))
    assert figs[f"{stale}: sync/max_logprob_diff"]["note"] == "skipped: vLLM is not installed"  # a line, not left out


def test_the_reports_staleness_bound_is_the_async_runs_flag(gpu_check, report):
    """The report's target for the async run's staleness is the ``--max-staleness`` that tiers.py gives it."""
    from gpu.tiers import ASYNC_FLAGS

    assert report.ASYNC_MAX_STALENESS == int(ASYNC_FLAGS[ASYNC_FLAGS.index("--max-staleness") + 1])


def test_the_te_tiers_report_from_recorded_results(report, tmp_path):
    results = json.loads((DATA / "gpu_check_te_results.json").read_text())
    _, json_path = report.write_report(results, tmp_path)
    figs = _by_name(json.loads(json_path.read_text())["figures"])
    assert figs["1.5B packed train step MFU, no TE"]["value"] == pytest.approx(0.335)
    bf16 = figs["1.5B packed train step MFU, TE bf16"]
    assert bf16["value"] == pytest.approx(0.402) and bf16["ok"] is False  # below the 45% target
    assert figs["1.5B packed train step, TE bf16 vs no TE"]["value"] == pytest.approx(0.402 / 0.335)
    assert figs["1.5B packed train step MFU, TE FP8 tensorwise"]["value"] == pytest.approx(0.482)
    assert figs["1.5B packed train step, TE FP8 vs TE bf16 tokens/s"]["value"] == pytest.approx(1.2)
    assert figs["1.5B packed train step peak memory, TE FP8 tensorwise"]["value"] == pytest.approx(48.9)
    assert figs["RL FP8 trainer, bf16 scores (synthetic): steps with finite loss"]["ok"] is True
    assert figs["score error B tensorwise 1k (mean)"]["value"] == pytest.approx(0.23)
    assert figs["auto (B) 4k score error, tensorwise"]["ok"] is True  # 0.88 <= A's 4.6
    drift = figs["log-prob sum drift over 4k tokens, B tensorwise (mean)"]
    assert drift["value"] == pytest.approx(11.9) and drift["note"] == "bf16: 2.1"
    assert figs["per-token log-prob bias, A tensorwise"]["value"] == pytest.approx(2.6e-3)
    assert not any(name.startswith("RL colocated") or "7B" in name for name in figs)

    cut = copy.deepcopy(results)
    cut["steps"]["fp8_drift"] = {"status": "skipped", "reason": "the budget leaves 80 s", "seconds": 0.0}
    stdout = cut["steps"]["train_step_1.5b_te_fp8"]["stdout"].splitlines()
    failed = "| train | packed | tensorwise | failed: no FP8 kernel |"  # bench_train_step's line for a failed row
    stdout = [failed if line.startswith("| train | packed | tensorwise |") else line for line in stdout]
    cut["steps"]["train_step_1.5b_te_fp8"]["stdout"] = "\n".join(stdout)
    figs = _by_name(report.figures(cut))
    assert "the budget leaves 80 s" in figs["--fp8-score-precision auto holds"]["note"]
    assert figs["1.5B packed train step MFU, TE FP8 tensorwise"]["note"].startswith("failed: no FP8 kernel")
