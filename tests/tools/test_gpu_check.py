"""tools/gpu_check.py and its report writer tools/gpu/report.py, without a GPU: the report from recorded results
(tests/tools/data/gpu_check_results.json, in the benchmarks' and pytest's own output formats), the benchmark table
format the report reads, pytest's JUnit results per test, and the refusal on a machine without CUDA."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).resolve().parent / "data" / "gpu_check_results.json"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return _load("gpu_report", ROOT / "tools" / "gpu" / "report.py")


@pytest.fixture
def results():
    return json.loads(RECORDED.read_text())


def _by_name(figures):
    return {f["name"]: f for f in figures}


def test_recorded_results_give_every_figure_beside_its_target(report, results, tmp_path):
    md_path, json_path = report.write_report(results, tmp_path)
    figs = _by_name(json.loads(json_path.read_text())["figures"])

    assert figs["fused log-probs: time vs naive"]["value"] == pytest.approx(0.46)
    assert figs["fused log-probs: time vs naive"]["ok"] is True
    assert figs["fused log-probs: peak memory vs naive"]["ok"] is True  # 0.17x <= 0.25x
    # Without TE the full step's MFU (packed, 18.3%) is below HF's fwd+bwd MFU (33.5%): a failed target.
    no_te = figs["1.5B train step MFU, no TE"]
    assert no_te["value"] == pytest.approx(0.183) and no_te["ok"] is False and "33.5%" in no_te["target"]
    assert figs["1.5B train step MFU, TE bf16"]["ok"] is False  # 20.7% < 45%
    assert figs["1.5B packed vs padded tokens/s, TE"]["value"] == pytest.approx(1.93)
    assert figs["1.5B packed vs padded tokens/s, TE"]["ok"] is True
    assert figs["7B FP8 delayed vs bf16 fwd+bwd (padded)"]["ok"] is True  # 1.24x
    assert figs["7B FP8 tensorwise vs bf16 fwd+bwd (padded)"]["ok"] is False  # 1.14x
    blockwise = figs["7B FP8 blockwise vs bf16 fwd+bwd (padded)"]
    assert blockwise["ok"] is None and "cuBLAS" in blockwise["note"]  # a failed row is a line with its reason
    assert figs["auto (B) 4k score error, delayed"]["ok"] is True  # 0.9 <= 5.8
    colocated = "RL colocated (ipc, sleep/wake, optimizer offload)"
    assert figs[f"{colocated}: sync/max_logprob_diff"]["value"] == pytest.approx(0.25)
    assert figs[f"{colocated}: sync/max_logprob_diff"]["ok"] is True  # bf16 bound 1.0
    assert figs[f"{colocated}: GPU memory freed by drop 1"]["value"] == pytest.approx(38.5)
    assert figs[f"{colocated}: perf/time/generate (last step)"]["value"] == pytest.approx(9.5)
    assert figs[f"{colocated}: colocate/freed_gb (last step)"]["value"] == pytest.approx(12.5)
    assert figs["RL FP8 trainer: sync/max_logprob_diff"]["ok"] is False  # 2.6 > the FP8 bound 2.0

    text = md_path.read_text()
    assert "| torch | 2.11.0+cu130 |" in text and "| vllm | 0.26.0 |" in text
    assert "2 passed, 1 failed, 1 skipped, 0 error" in text
    assert "MXFP8 needs Blackwell" in text  # each skip with its reason
    assert "| diag_te_fp32 | timeout | 90 | stopped after 90 s |" in text


def test_whatever_could_not_run_is_a_line_with_its_reason(report, results, tmp_path):
    steps = results["steps"]
    for name in ("train_step_1.5b_te", "train_step_7b_fp8", "bench_fp8_drift"):
        steps[name] = {"status": "skipped", "reason": "Transformer Engine is not installed", "seconds": 0.0}
    del steps["bench_logprobs"]  # never reached (the budget ran out before it, say)
    steps["rl_colocated"] = {"status": "failed", "reason": "exit 1: CUDA out of memory", "seconds": 12.0}
    md_path, json_path = report.write_report(results, tmp_path)
    figs = json.loads(json_path.read_text())["figures"]
    unmeasured = {f["name"]: f["note"] for f in figs if f["value"] is None}

    assert unmeasured["fused log-probs: time vs naive"] == "not run"
    assert unmeasured["1.5B train step MFU, TE bf16"] == "skipped: Transformer Engine is not installed"
    assert unmeasured["7B FP8 vs bf16 fwd+bwd"] == "skipped: Transformer Engine is not installed"
    assert (
        "CUDA out of memory" in unmeasured["RL colocated (ipc, sleep/wake, optimizer offload): sync/max_logprob_diff"]
    )
    assert "NCCL broadcast" in unmeasured["RL separate engines (NCCL broadcast): sync/max_logprob_diff"]
    text = md_path.read_text()
    assert text.count("not measured") == len(unmeasured)


def test_baseline_gives_the_change_of_every_figure(report, results, tmp_path):
    _, old_json = report.write_report(results, tmp_path / "old")
    baseline = json.loads(old_json.read_text())
    newer = copy.deepcopy(results)
    newer["steps"]["bench_logprobs"]["stdout"] = newer["steps"]["bench_logprobs"]["stdout"].replace(
        "| fused | 4.90 | 1190 | 0.46x | 0.17x |", "| fused | 5.90 | 1190 | 0.55x | 0.17x |"
    )
    md_path, json_path = report.write_report(newer, tmp_path / "new", baseline)
    changes = _by_name(json.loads(json_path.read_text())["changes"])

    numeric = [f for f in baseline["figures"] if isinstance(f["value"], (int, float))]
    assert len(changes) == len(numeric) > 20
    moved = changes["fused log-probs: time vs naive"]
    assert (moved["old"], moved["new"]) == (pytest.approx(0.46), pytest.approx(0.55))
    assert moved["change"] == pytest.approx(0.09 / 0.46)
    assert changes["1.5B HF fwd+bwd MFU"]["change"] == 0
    assert "| fused log-probs: time vs naive | 0.46 | 0.55 | +19.6% |" in md_path.read_text()


def test_the_train_step_table_is_read_as_bench_train_step_prints_it(report, capsys):
    """The parser against the benchmark's own printer (a format change there fails here)."""
    import argparse

    bench = _load("bench_train_step", ROOT / "benchmarks" / "bench_train_step.py")

    def row(variant, layout, precision, seconds, mfu):
        return dict(
            variant=variant,
            layout=layout,
            precision=precision,
            seconds=seconds,
            tokens_per_s=1e5 / seconds,
            tflops=400 * mfu,
            mfu=mfu,
            peak_gib=40.0,
            padding=0.1,
            device="NVIDIA H100",
        )

    rows = [
        row("hf", "padded", "bf16", 0.14, 0.335),
        row("train", "padded", "bf16", 0.30, 0.40),
        row("train", "packed", "bf16", 0.15, 0.47),
    ]
    args = argparse.Namespace(shape="1.5b", prompts=8, group_size=8, scale=1, micro_batch_size=2, fp8=[])
    bench.print_table(rows, args)
    step = {"status": "ok", "stdout": capsys.readouterr().out}
    figs = _by_name(report.train_step_figures(step, step))

    assert figs["1.5B HF fwd+bwd MFU"]["value"] == pytest.approx(0.335)
    assert figs["1.5B train step MFU, no TE"]["value"] == pytest.approx(0.47)
    assert figs["1.5B train step MFU, TE bf16"]["ok"] is True
    assert figs["1.5B packed vs padded tokens/s, TE"]["value"] == pytest.approx(2.0)


def test_junit_results_give_each_test_its_status_and_reason(tmp_path):
    machine = _load("gpu_machine", ROOT / "tools" / "gpu" / "machine.py")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs CUDA')\ndef test_skipped():\n    pass\n"
    )
    xml = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_sample.py"]
    subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    tests = {t["id"].rsplit("::", 1)[1]: t for t in machine.junit_results(xml)}

    assert tests["test_ok"]["status"] == "passed"
    assert tests["test_bad"]["status"] == "failed" and "one is not two" in tests["test_bad"]["reason"]
    assert tests["test_skipped"] == {"id": tests["test_skipped"]["id"], "status": "skipped", "reason": "needs CUDA"}


def test_without_cuda_it_says_so_and_exits_nonzero(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: make gpu-check would run")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA GPU visible" in proc.stderr and "one or more CUDA GPUs" in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing half-written


def test_each_step_is_recorded_as_it_ends_and_the_budget_skips_the_rest(tmp_path):
    """The orchestration without a GPU: real subprocess steps (ok, failed, timed out), results.json written after
    each, and a step the budget no longer allows recorded as skipped with that reason."""
    import argparse

    gpu_check = _load("gpu_check", ROOT / "tools" / "gpu" / "check.py")
    args = argparse.Namespace(out=tmp_path / "r", budget_min=1.0, only=[], baseline=None)
    check = gpu_check.Check(args)
    check.t0 = check.deadline - 60
    ok = check.run("fine", [sys.executable, "-c", "print('| a |'); print('|---|'); print('| 1 |')"], 30)
    bad = check.run("broken", [sys.executable, "-c", "import sys; sys.exit('no TE here')"], 30)
    slow = check.run("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 2)
    check.deadline = 0.0  # the budget is spent
    late = check.run("late", [sys.executable, "-c", "pass"], 30)
    recorded = json.loads((tmp_path / "r" / "results.json").read_text())["steps"]

    assert ok["status"] == "ok" and "| 1 |" in recorded["fine"]["stdout"]
    assert bad["status"] == "failed" and "no TE here" in recorded["broken"]["reason"]
    assert slow["status"] == "timeout" and recorded["slow"]["reason"] == "stopped after 2 s"
    assert late["status"] == "skipped" and "budget is spent" in recorded["late"]["reason"]
    assert (tmp_path / "r" / "logs" / "broken.log").read_text().startswith("$ ")


def test_the_trainer_tier_reports_resume_against_continuous_and_the_time_split(report, tmp_path):
    """The trainer tier's synthetic runs: ``resume == continuous`` is a figure with its target (a difference names
    the metrics and the weights' gap), and a resumed run that did not run is a line with its reason."""
    step = {"train/loss": 0.5, "perf/time/step": 2.0, "perf/time/sync": 0.3, "ref/resets": 1.0}
    continuous = {"status": "ok", "metrics": [step]}
    figures = _by_name(report.synthetic_figures(continuous, {"status": "ok", "resume_equals_continuous": True}))
    assert figures["RL synthetic (no fleet): resume == continuous"]["ok"] is True
    assert figures["RL synthetic (no fleet): perf/time/sync (last step)"]["value"] == 0.3
    differed = {
        "status": "ok",
        "resume_equals_continuous": False,
        "resume_comparison": {
            "equal": False,
            "metrics": {"train/loss": [0.5, 0.5], "train/grad_norm": [1.25, 1.2500001]},
            "weights": "max abs diff 0.000244 over 290 tensors",
        },
    }
    figure = _by_name(report.synthetic_figures(continuous, differed))["RL synthetic (no fleet): resume == continuous"]
    assert figure["ok"] is False and "train/grad_norm: 1.25 vs 1.2500001" in figure["note"]
    assert "train/loss" not in figure["note"] and "max abs diff 0.000244" in figure["note"]
    missing = _by_name(report.synthetic_figures(continuous, {"status": "timeout", "reason": "stopped after 120 s"}))
    assert "stopped after 120 s" in missing["RL synthetic (no fleet): resume == continuous"]["note"]


def test_the_trainer_tier_reports_the_async_save_hold_against_the_synchronous_one(report):
    """The synchronous run's saves (rows after the first) against the ``--async-save`` resumed run's: both medians
    and their ratio, checked against the 10% target; a run without save holds is a line with the reason."""

    def run(*holds):
        return {"status": "ok", "metrics": [{"train/loss": 0.5, "perf/time/save": h} for h in (9.0, *holds)]}

    figures = _by_name(report.save_hold_figures("X", run(3.0, 5.0, 4.0), run(0.3)))
    assert figures["X: sync save hold (median)"]["value"] == 4.0
    assert figures["X: async / sync save hold"]["value"] == pytest.approx(0.075)
    assert figures["X: async / sync save hold"]["ok"] is True
    assert _by_name(report.save_hold_figures("X", run(3.0), run(0.6)))["X: async / sync save hold"]["ok"] is False
    missing = _by_name(report.save_hold_figures("X", run(3.0), run()))["X: async / sync save hold"]
    assert missing["value"] is None and "no save hold" in missing["note"]


def test_the_trainer_tier_needs_no_te_vllm_ray_or_math_verify_and_fits_its_budget(tmp_path):
    """``--tier trainer``: 6.5 minutes by default (a short GPU loan's quick check leaves it ~7.5), and its synthetic
    runs are valid runs without a fleet."""
    gpu_check = _load("gpu_check", ROOT / "tools" / "gpu" / "check.py")
    assert gpu_check.TIER_BUDGET_MIN["trainer"] == 6.5
    flags = " ".join(gpu_check.SYNTHETIC_FLAGS)
    assert "--rollout-source synthetic" in flags and "--num-engines" not in flags
    from megatron_pacs.config import parse_config

    cfg = parse_config(["--hf-model", "m", "--train-data", "d", *gpu_check.SYNTHETIC_FLAGS])
    cfg.validate(1, need_files=False)  # a valid run: no fleet flag among them
    assert cfg.loss.needs_reference and cfg.reference.ref_reset_interval == 2


def test_the_resume_comparison_gives_the_weights_gap_and_every_metric(tmp_path):
    """``_resume_comparison`` on two exported checkpoints: equal files are ``equal``; a changed tensor gives its
    largest absolute difference, and the metrics of both last steps travel with the verdict."""
    import torch
    from safetensors.torch import save_file

    gpu_check = _load("gpu_check", ROOT / "tools" / "gpu" / "check.py")
    for name, bump in (("a", 0.0), ("b", 0.0), ("c", 0.5)):
        (tmp_path / name / "hf").mkdir(parents=True)
        save_file({"w": torch.ones(3) + bump, "v": torch.zeros(2)}, tmp_path / name / "hf" / "model.safetensors")
    step = {"metrics": [{"train/loss": 0.5, "train/grad_norm": 1.0}]}
    same = gpu_check._resume_comparison(step, step, tmp_path / "a", tmp_path / "b")
    assert same["equal"] and same["weights"] == "equal"
    other = {"metrics": [{"train/loss": 0.5, "train/grad_norm": 1.5}]}
    differs = gpu_check._resume_comparison(step, other, tmp_path / "a", tmp_path / "c")
    assert not differs["equal"] and differs["weights"] == "max abs diff 0.5 over 2 tensors"
    assert differs["metrics"]["train/grad_norm"] == [1.0, 1.5]


@pytest.mark.slow  # a whole pytest collection in a subprocess, ~10 s
def test_the_gpu_tests_are_collected_on_a_machine_without_the_fleet_stack():
    """The trainer tier's ``pytest tests -m gpu`` on an image without Ray, vLLM or math-verify: every test module
    is collected (one that needs the fleet skips with its reason), so no collection error fails the whole step
    (as a module that imports the fleet, and with it Ray, at its top would)."""
    from helpers.runs import NO_FLEET_STACK

    env = {**os.environ, "PYTHONPATH": f"{NO_FLEET_STACK}:{ROOT}"}
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower() and "tests/mcore/test_fused_logprobs.py::" in proc.stdout


def test_the_trainer_tier_compares_ppo_with_grpo_on_valid_runs(report):
    """Issue 51: the trainer tier ends with three synthetic GRPO steps and three PPO steps (critic warm-up at step 1)
    on the same shape; both are runs the CLI accepts (the PACS-only flags of the tier's other run dropped), and the
    report gives PPO's step time and peak GPU memory as ratios to GRPO's (the first step, which warms up, left out)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu.tiers import CRITIC_COMPARISON

    from megatron_pacs.config import parse_config

    data = ["--hf-model", "m", "--train-data", "d"]
    grpo, ppo = (parse_config([*data, *CRITIC_COMPARISON[n]]) for n in ("rl_synthetic_grpo", "rl_synthetic_ppo"))
    assert (grpo.loss.loss, ppo.loss.loss, ppo.critic.critic_warmup) == ("grpo", "ppo", 1)
    assert grpo.source.rollout_source == ppo.source.rollout_source == "synthetic" and ppo.model.bf16

    def run(times, peak):
        return {"status": "ok", "metrics": [{"perf/time/step": t} for t in times], "memory": {"peak_gib": peak}}

    figures = _by_name(report.critic_figures(run([9.0, 1.0, 1.2, 1.1], 20.0), run([9.0, 1.6, 1.8, 1.7], 30.0)))
    assert figures["PPO / GRPO (synthetic): step time"]["value"] == pytest.approx(1.7 / 1.1)
    assert figures["PPO / GRPO (synthetic): peak GPU memory"]["value"] == pytest.approx(1.5)
    skipped = report.critic_figures(run([1.0], 1.0), {"status": "skipped", "reason": "the budget is spent"})
    assert skipped[0]["value"] is None and "the budget is spent" in skipped[0]["note"]
