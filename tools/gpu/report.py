#!/usr/bin/env python3
"""The report of ``make gpu-check`` (tools/gpu_check.py): ``report.md`` and ``report.json`` from recorded results.

Pure and stdlib-only, so it is unit-tested on recorded results without a GPU (tests/tools/test_gpu_check.py) and can
re-render a finished run: ``python tools/gpu/report.py gpu-report/results.json [--baseline old/report.json]``.

The results (``results.json``, written step by step by gpu_check.py) hold:

- ``tier``: which plan ran (``trainer``, ``full``, ``rollout``, ``te``; absent: ``full``), which picks the figures;
- ``environment``: GPU names, driver, torch/CUDA, TE, vLLM, Megatron-Core, mbridge versions (``None`` = absent);
- ``steps``: ``{name: {"status": "ok" | "failed" | "skipped" | "timeout", "reason", "seconds", "cmd",
  "stdout", ...}}`` for the gpu-marked tests (with ``tests``: one entry per test), each benchmark and each
  end-to-end run (with ``metrics``: its ``metrics.jsonl`` rows and ``memory``: the GPU memory timeline).

Figures are extracted from the benchmarks' markdown tables and the runs' metrics and set beside their targets
(docs/architecture.md, "GPU check"); a figure that cannot be read is a line with the reason, never left out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

BF16_SYNC_BOUND = 1.0  # docs/algorithm.md §7.1: engine vs trainer, bf16 on GPU
FP8_SYNC_BOUND = 2.0  # the same, FP8 trainer vs bf16 engine
ASYNC_MAX_STALENESS = 2  # the rollout tier's rl_async: --max-staleness in tools/gpu/tiers.py's ASYNC_FLAGS


def parse_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text`` as a list of rows keyed by the header cells."""
    tables: list[list[dict[str, str]]] = []
    lines = [line.strip() for line in (text or "").splitlines()]
    i = 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(header, cells + [""] * (len(header) - len(cells)), strict=False)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _number(cell: str | None) -> float | None:
    """``"12.5"``, ``"0.58x"``, ``"45.1%"`` -> 12.5, 0.58, 0.451; anything else -> None."""
    if cell is None:
        return None
    m = re.fullmatch(r"\s*(-?[0-9.]+(?:e-?\d+)?)\s*(x|%)?\s*", cell)
    if not m:
        return None
    value = float(m.group(1))
    return value / 100 if m.group(2) == "%" else value


def _figure(name: str, value: float | None, target: str, ok: bool | None, unit: str = "", note: str = "") -> dict:
    return {"name": name, "value": value, "unit": unit, "target": target, "ok": ok, "note": note}


def _missing(name: str, target: str, why: str) -> dict:
    return _figure(name, None, target, None, note=why)


def _step_problem(step: dict | None) -> str | None:
    if step is None:
        return "not run"
    if step.get("status") != "ok":
        return f"{step.get('status', '?')}: {step.get('reason', '')}".strip()
    return None


def _rows(step: dict | None) -> list[dict[str, str]]:
    return [row for table in parse_tables((step or {}).get("stdout", "")) for row in table]


def logprob_figures(step: dict | None) -> list[dict]:
    name_t, name_m = "fused log-probs: time vs naive", "fused log-probs: peak memory vs naive"
    problem = _step_problem(step)
    if problem:
        return [_missing(name_t, "<= 0.6x", problem), _missing(name_m, "<= 0.25x", problem)]
    fused = next((r for r in _rows(step) if r.get("implementation") == "fused"), None)
    if fused is None:
        return [_missing(n, t, "no 'fused' row in the output") for n, t in ((name_t, "<= 0.6x"), (name_m, "<= 0.25x"))]
    t, m = _number(fused.get("time ratio vs naive")), _number(fused.get("memory ratio vs naive"))
    return [
        _figure(name_t, t, "<= 0.6x", None if t is None else t <= 0.6, "x"),
        _figure(name_m, m, "<= 0.25x", None if m is None else m <= 0.25, "x"),
    ]


def _pick(rows, variant: str, layout: str, precision: str = "bf16") -> dict | None:
    return next(
        (r for r in rows if (r.get("variant"), r.get("layout"), r.get("precision")) == (variant, layout, precision)),
        None,
    )


def train_step_figures(no_te: dict | None, te: dict | None) -> list[dict]:
    """1.5B: full-step MFU >= HF's fwd+bwd MFU without TE, >= 45% with TE; packed >= 1.8x padded tokens/s."""
    out = []
    problem = _step_problem(no_te)
    if problem:
        out.append(_missing("1.5B train step MFU, no TE (vs HF fwd+bwd MFU)", ">= HF", problem))
    else:
        rows = _rows(no_te)
        hf, ours = _pick(rows, "hf", "padded"), _pick(rows, "train", "packed") or _pick(rows, "train", "padded")
        hf_mfu, mfu = _number((hf or {}).get("MFU")), _number((ours or {}).get("MFU"))
        if hf_mfu is None or mfu is None:
            out.append(_missing("1.5B train step MFU, no TE (vs HF fwd+bwd MFU)", ">= HF", "hf or train row missing"))
        else:
            out.append(_figure("1.5B HF fwd+bwd MFU", hf_mfu, "baseline", None, "%"))
            out.append(_figure("1.5B train step MFU, no TE", mfu, f">= {hf_mfu:.1%} (HF)", mfu >= hf_mfu, "%"))
    problem = _step_problem(te)
    if problem:
        out.append(_missing("1.5B train step MFU, TE bf16", ">= 45%", problem))
        out.append(_missing("1.5B packed vs padded tokens/s, TE", ">= 1.8x", problem))
        return out
    rows = _rows(te)
    packed, padded = _pick(rows, "train", "packed"), _pick(rows, "train", "padded")
    mfu = _number((packed or padded or {}).get("MFU"))
    out.append(
        _figure("1.5B train step MFU, TE bf16", mfu, ">= 45%", None if mfu is None else mfu >= 0.45, "%")
        if mfu is not None
        else _missing("1.5B train step MFU, TE bf16", ">= 45%", "no train row")
    )
    ratio = _number((packed or {}).get("vs padded"))
    out.append(
        _figure("1.5B packed vs padded tokens/s, TE", ratio, ">= 1.8x", ratio >= 1.8, "x")
        if ratio is not None
        else _missing("1.5B packed vs padded tokens/s, TE", ">= 1.8x", "no packed train row")
    )
    return out


def fp8_figures(step: dict | None) -> list[dict]:
    """7B fwd+bwd, TE: each FP8 recipe's tokens/s vs bf16 (>= 1.2x)."""
    problem = _step_problem(step)
    if problem:
        return [_missing("7B FP8 vs bf16 fwd+bwd", ">= 1.2x", problem)]
    rows = [r for r in _rows(step) if r.get("variant") == "fwd_bwd" and r.get("precision") not in ("bf16", None)]
    out = []
    for r in rows:
        name = f"7B FP8 {r.get('precision')} vs bf16 fwd+bwd ({r.get('layout')})"
        value = _number(r.get("vs bf16"))
        out.append(
            _figure(name, value, ">= 1.2x", value >= 1.2, "x")
            if value is not None
            else _missing(name, ">= 1.2x", r.get("ms/step", "no figure")[:120])
        )
    return out or [_missing("7B FP8 vs bf16 fwd+bwd", ">= 1.2x", "no FP8 rows in the output")]


def drift_figures(step: dict | None) -> list[dict]:
    """PACS score error vs fp32 per option at 1k and all (4k) tokens. ``--fp8-score-precision auto`` means option B
    for PACS (FP8 training, bf16 score passes; bench_fp8_drift.py): it holds when, per recipe, B's 4k error is no
    larger than A's (scores in FP8 too)."""
    target = "B (auto) <= A per recipe"
    problem = _step_problem(step)
    if problem:
        return [_missing("--fp8-score-precision auto holds", target, problem)]
    out = []
    errors: dict[tuple[str, str], float] = {}
    for r in _rows(step):
        option, recipe = r.get("option", "?"), r.get("recipe", "-")
        for col, label in (("score err 1k mean / max", "1k"), ("score err all mean / max", "4k")):
            mean = _number((r.get(col) or "").split("/")[0])
            if mean is not None:
                out.append(_figure(f"score error {option} {recipe} {label} (mean)", mean, "info", None, "nats"))
                if label == "4k":
                    errors[(option, recipe)] = mean
    recipes = sorted({rec for opt, rec in errors if opt == "B" and (("A", rec) in errors)})
    for rec in recipes:
        b, a = errors[("B", rec)], errors[("A", rec)]
        out.append(_figure(f"auto (B) 4k score error, {rec}", b, f"<= {a:.3g} (A)", b <= a, "nats"))
    if not recipes:
        out.append(_missing("--fp8-score-precision auto holds", target, "no recipe with both A and B rows"))
    return out


def e2e_figures(name: str, step: dict | None, bound: float) -> list[dict]:
    problem = _step_problem(step)
    if problem:
        return [_missing(f"RL {name}: sync/max_logprob_diff", f"<= {bound}", problem)]
    assert step is not None  # _step_problem says "not run" for None
    metrics = step.get("metrics", [])
    if not metrics:
        return [_missing(f"RL {name}: sync/max_logprob_diff", f"<= {bound}", "the run wrote no metrics")]
    out = []
    diffs = [m["sync/max_logprob_diff"] for m in metrics if "sync/max_logprob_diff" in m]
    if diffs:
        out.append(_figure(f"RL {name}: sync/max_logprob_diff", max(diffs), f"<= {bound}", max(diffs) <= bound))
    else:
        out.append(_missing(f"RL {name}: sync/max_logprob_diff", f"<= {bound}", "no sync probe in the metrics"))
    rewards = [m.get("rollout/reward_mean") for m in metrics]
    rewards = [r for r in rewards if r is not None]
    if rewards:
        out.append(_figure(f"RL {name}: reward mean (last step)", rewards[-1], "info", None))
    last = metrics[-1]
    for key in sorted(k for k in last if k.startswith("perf/time/")):
        out.append(_figure(f"RL {name}: {key} (last step)", last[key], "info", None, "s"))
    if "colocate/freed_gb" in last:  # what the trainer's allocator gave back before the engines woke
        freed = last["colocate/freed_gb"]
        out.append(_figure(f"RL {name}: colocate/freed_gb (last step)", freed, "info", None, "GiB", "torch allocator"))
    memory = step.get("memory") or {}
    for phase, gib in memory.get("freed_gib", {}).items():
        out.append(_figure(f"RL {name}: GPU memory freed by {phase}", gib, "info", None, "GiB", "nvidia-smi samples"))
    return out


def _resume_note(resumed: dict | None) -> str:
    """What differed between the resumed and the continuous run's last step (empty when nothing did)."""
    comparison = (resumed or {}).get("resume_comparison") or {}
    parts = [f"{k}: {a!r} vs {b!r}" for k, (a, b) in comparison.get("metrics", {}).items() if a != b]
    if comparison and comparison.get("weights") != "equal":
        parts.append(f"weights: {comparison.get('weights')}")
    if comparison and not comparison.get("metrics"):
        parts.append("a run wrote no per-step metrics")
    return "; ".join(parts)


def synthetic_figures(continuous: dict | None, resumed: dict | None) -> list[dict]:
    """The trainer without the fleet: resume == continuous on the GPU, and the last step's time split."""
    name = "RL synthetic (no fleet)"
    problem = _step_problem(continuous)
    if problem:
        return [_missing(f"{name}: resume == continuous", "True", problem)]
    out = []
    problem = _step_problem(resumed)
    if problem:
        out.append(_missing(f"{name}: resume == continuous", "True", problem))
    else:
        same = bool(resumed.get("resume_equals_continuous")) if resumed else False
        out.append(_figure(f"{name}: resume == continuous", same, "True", same, note=_resume_note(resumed)))
    steps = [m for m in (continuous or {}).get("metrics", []) if "train/loss" in m]
    if steps:
        last = steps[-1]
        for key in sorted(k for k in last if k.startswith("perf/time/")):
            out.append(_figure(f"{name}: {key} (last step)", last[key], "info", None, "s"))
        out.append(_figure(f"{name}: ref/resets (last step)", last.get("ref/resets"), "info", None))
    out += save_hold_figures(name, continuous, resumed)
    return out


def critic_figures(grpo: dict | None, ppo: dict | None) -> list[dict]:
    """PPO against GRPO on the same shape and rollouts (trainer tier): the median step time after the first and the
    peak GPU memory, as ratios (ReMax, arXiv 2310.10505, saw PPO ~1.6x slower and ~1.9x the memory at 7B)."""
    name = "PPO / GRPO (synthetic)"
    problem = _step_problem(grpo) or _step_problem(ppo)
    if problem:
        return [_missing(f"{name}: step time", "info", problem)]

    def step_s(step: dict) -> float | None:
        times = [m["perf/time/step"] for m in step.get("metrics", []) if "perf/time/step" in m][1:]
        return statistics.median(times) if times else None

    def peak(step: dict) -> float | None:
        return (step.get("memory") or {}).get("peak_gib")

    out = []
    for label, of in (("step time", step_s), ("peak GPU memory", peak)):
        a, b = of(grpo or {}), of(ppo or {})
        ratio = b / a if a and b else None
        out.append(_figure(f"{name}: {label}", ratio, "info", None, "x", note=f"GRPO {a}, PPO {b}"))
    return out


def _holds(step: dict | None) -> list[float]:
    """A run's save holds: ``perf/time/save`` plus ``perf/time/save_wait`` (the wait for a save still in flight) in
    the rows after the first (each row holds the previous save's)."""
    rows = [m for m in (step or {}).get("metrics", []) if "train/loss" in m]
    return [
        m["perf/time/save"] + m.get("perf/time/save_wait", 0.0)
        for m in rows[1:]
        if isinstance(m.get("perf/time/save"), (int, float))
    ]


def save_hold_figures(name: str, sync: dict | None, background: dict | None) -> list[dict]:
    """How long a checkpoint holds the step: the synchronous run's saves against the ``--async-save`` run's
    (issue target: at most 10% of a synchronous save's hold)."""
    a, b = _holds(sync), _holds(background)
    if not a or not b:
        return [_missing(f"{name}: async / sync save hold", "<= 0.1", "no save hold in a run's metrics")]
    median_a, median_b = statistics.median(a), statistics.median(b)
    return [
        _figure(f"{name}: sync save hold (median)", median_a, "info", None, "s"),
        _figure(f"{name}: async save hold (median)", median_b, "info", None, "s"),
        _figure(f"{name}: async / sync save hold", median_b / median_a, "<= 0.1", median_b <= 0.1 * median_a),
    ]


def _worst(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if isinstance(m.get(key), (int, float))]
    return max(values) if values else None


def engine_run_figures(label: str, step: dict | None, *, on_policy: bool = True) -> list[dict]:
    """A run with a vLLM CUDA engine (rollout tier): :func:`e2e_figures`, the engine's start, generation tokens/s,
    the GPU memory timeline and engine vs trainer log-probs in bf16 (docs/algorithm.md §7.1), worst step.

    ``on_policy=False`` (an asynchronous run): its rollouts come from older weights, so the trainer logs no
    ``consistency/*`` and the generation time is not the engine's own; neither is reported (the sync probe is)."""
    out = e2e_figures(label, step, BF16_SYNC_BOUND)
    if _step_problem(step) or not (step or {}).get("metrics"):
        return out
    assert step is not None
    name, metrics = f"RL {label}", step["metrics"]
    start = step.get("engine_start_s")
    out.append(
        _figure(f"{name}: engine start", start, "info", None, "s")
        if start is not None
        else _missing(f"{name}: engine start", "info", "no 'engine(s) ready in' line in the run's log")
    )
    rates = []
    for m in metrics:
        prompt, response = m.get("rollout/prompt_len_mean"), m.get("rollout/response_len_mean")
        if m.get("perf/time/generate") and m.get("rollout/num_tokens") and prompt is not None and response:
            rates.append(m["rollout/num_tokens"] * response / (prompt + response) / m["perf/time/generate"])
    if rates and on_policy:
        out.append(_figure(f"{name}: generated tokens/s (last step)", rates[-1], "info", None, note="responses only"))
    bound = f"<= {BF16_SYNC_BOUND}"
    comparisons = (
        ("consistency/logprob_abs_diff_max", "engine vs trainer max abs(d logp), bf16", bound),
        ("consistency/logprob_abs_diff_mean", "engine vs trainer mean abs(d logp), bf16", "info"),
        ("consistency/k3", "engine vs trainer k3, bf16", "info"),
        ("consistency/seq_logprob_abs_diff_max", "first mini-batch's abs(log ratio) per response, max", "info"),
    )
    for key, what, target in comparisons if on_policy else ():
        worst = _worst(metrics, key)
        if worst is None:
            out.append(_missing(f"{name}: {what}", target, f"no {key} in the metrics"))
        else:
            ok = worst <= BF16_SYNC_BOUND if target == bound else None
            out.append(_figure(f"{name}: {what} (worst step)", worst, target, ok, note=key))
    memory = step.get("memory") or {}
    if memory.get("peak_gib") is not None:
        points = memory.get("timeline") or []
        trace = ", ".join(f"{t:.0f} s {gib:.1f}" for t, gib in points[:: max(1, len(points) // 12)])
        out.append(_figure(f"{name}: GPU memory peak", memory["peak_gib"], "info", None, "GiB", trace))
    return out


def async_figures(label: str, step: dict | None) -> list[dict]:
    """An asynchronous run (``--max-staleness``, rollout tier): :func:`engine_run_figures` without the on-policy
    comparisons, the worst step's token staleness against ``--max-staleness``, the largest share of responses
    generated under more than one weight version (partial rollouts) and the last step's tokens/s end to end."""
    out = engine_run_figures(label, step, on_policy=False)
    if _step_problem(step) or not (step or {}).get("metrics"):
        return out
    assert step is not None
    name, metrics = f"RL {label}", step["metrics"]
    target = f"<= {ASYNC_MAX_STALENESS}"
    stale = _worst(metrics, "rollout/staleness_token_max")
    out.append(
        _figure(f"{name}: updates behind per token, max (worst step)", stale, target, stale <= ASYNC_MAX_STALENESS)
        if stale is not None
        else _missing(f"{name}: updates behind per token, max", target, "no rollout/staleness_token_max")
    )
    spanning = _worst(metrics, "rollout/spanning_responses")
    note = "rollout/spanning_responses: share of the step's responses"
    out.append(
        _figure(f"{name}: responses spanning a weight update (worst step)", spanning, "info", None, note=note)
        if spanning is not None
        else _missing(f"{name}: responses spanning a weight update", "info", "no rollout/spanning_responses")
    )
    rate = [m["perf/tokens_per_sec"] for m in metrics if isinstance(m.get("perf/tokens_per_sec"), (int, float))]
    out.append(
        _figure(f"{name}: perf/tokens_per_sec (last step)", rate[-1], "info", None, note="prompt + response tokens")
        if rate
        else _missing(f"{name}: perf/tokens_per_sec", "info", "no perf/tokens_per_sec in the metrics")
    )
    return out


def routed_experts_figures(step: dict | None) -> list[dict]:
    """R3 from a real engine: the gpu test's verdict (a test that skipped itself is a line with its reason)."""
    name, problem = "R3: routed experts from a vLLM engine replayed by the trainer", _step_problem(step)
    if problem:
        return [_missing(name, "passed", problem)]
    assert step is not None
    tests = step.get("tests") or []
    passed = bool(tests) and all(t["status"] == "passed" for t in tests)
    return [_figure(name, passed, "passed", passed, note="; ".join(t.get("reason", "") for t in tests)[:200])]


def te_train_step_figures(te: dict | None, no_te: dict | None) -> list[dict]:
    """TE tier: the 1.5B packed train step on the TE spec in bf16 and FP8 against the same step without TE."""
    out = []
    base = _pick(_rows(no_te), "train", "packed")
    base_mfu = _number((base or {}).get("MFU"))
    if base_mfu is None:
        out.append(_missing("1.5B packed train step MFU, no TE", "info", _step_problem(no_te) or "no train row"))
    else:
        out.append(_figure("1.5B packed train step MFU, no TE", base_mfu, "info", None, "%"))
        peak = _number((base or {}).get("peak GiB"))
        out.append(_figure("1.5B packed train step peak memory, no TE", peak, "info", None))
    problem, rows = _step_problem(te), _rows(te)
    for precision, label in (("bf16", "TE bf16"), ("tensorwise", "TE FP8 tensorwise")):
        row = _pick(rows, "train", "packed", precision)
        mfu = _number((row or {}).get("MFU"))
        name = f"1.5B packed train step MFU, {label}"
        if mfu is None:
            why = problem or ((row or {}).get("ms/step") or f"no {precision} train row")[:160]
            out.append(_missing(name, ">= 45%" if precision == "bf16" else "info", why))
            continue
        assert row is not None
        if precision == "bf16":
            out.append(_figure(name, mfu, ">= 45%", mfu >= 0.45, "%"))
            if base_mfu:
                ratio = mfu / base_mfu
                out.append(_figure("1.5B packed train step, TE bf16 vs no TE", ratio, ">= 1.0x", ratio >= 1.0, "x"))
        else:
            out.append(_figure(name, mfu, "info", None, "%"))
            speed = _number(row.get("vs bf16"))
            out.append(_figure("1.5B packed train step, TE FP8 vs TE bf16 tokens/s", speed, "info", None, "x"))
        out.append(_figure(f"1.5B packed train step peak memory, {label}", _number(row.get("peak GiB")), "info", None))
    return out


def drift_vs_bf16_figures(step: dict | None) -> list[dict]:
    """TE tier: each FP8 option's per-token bias and its log-prob sum's drift over 4k tokens, beside bf16's."""
    if _step_problem(step):
        return []
    rows = [r for r in _rows(step) if _number((r.get("token bias") or "").strip()) is not None]
    bf16 = next((r for r in rows if r.get("option") == "bf16"), None)
    base = _number((bf16 or {}).get("sum drift all mean / max", "").split("/")[0])
    out = []
    for r in rows:
        label = f"{r.get('option')} {r.get('recipe', '-')}".replace(" -", "")
        drift = _number((r.get("sum drift all mean / max") or "").split("/")[0])
        note = f"bf16: {base:.3g}" if base is not None and r is not bf16 else ""
        out.append(_figure(f"log-prob sum drift over 4k tokens, {label} (mean)", drift, "info", None, "nats", note))
        out.append(_figure(f"per-token log-prob bias, {label}", _number(r.get("token bias")), "info", None, "nats"))
    return out


def fp8_rl_figures(step: dict | None) -> list[dict]:
    """TE tier: three synthetic PACS steps with an FP8 trainer and bf16 score passes: all ran, with finite losses."""
    name = "RL FP8 trainer, bf16 scores (synthetic)"
    problem = _step_problem(step)
    if problem:
        return [_missing(f"{name}: 3 steps with finite loss", "3", problem)]
    assert step is not None
    steps = [m for m in step.get("metrics", []) if "train/loss" in m]
    finite = [m for m in steps if m["train/loss"] == m["train/loss"] and abs(m["train/loss"]) != float("inf")]
    out = [_figure(f"{name}: steps with finite loss", len(finite), "3", len(finite) == 3)]
    for key in sorted(k for k in (steps[-1] if steps else {}) if k.startswith(("perf/time/", "consistency/fp8_gap"))):
        out.append(_figure(f"{name}: {key} (last step)", steps[-1][key], "info", None))
    return out


def figures(results: dict) -> list[dict]:
    """Every figure of the run's tier with its target (``ok``: True / False / None = informational or unmeasured)."""
    steps = results.get("steps", {})
    if results.get("tier") == "rollout":
        out = engine_run_figures("colocated (ipc, sleep/wake, optimizer offload)", steps.get("rl_colocated"))
        label = f"async, {ASYNC_MAX_STALENESS} updates stale, partial rollouts"
        out += async_figures(label, steps.get("rl_async"))
        return out + routed_experts_figures(steps.get("r3_routed_experts"))
    if results.get("tier") == "te":
        out = te_train_step_figures(steps.get("train_step_1.5b_te_fp8"), steps.get("train_step_1.5b_no_te_packed"))
        out += fp8_rl_figures(steps.get("rl_fp8_synthetic"))
        return out + drift_figures(steps.get("fp8_drift")) + drift_vs_bf16_figures(steps.get("fp8_drift"))
    out = logprob_figures(steps.get("bench_logprobs"))
    out += train_step_figures(steps.get("train_step_1.5b_no_te"), steps.get("train_step_1.5b_te"))
    out += fp8_figures(steps.get("train_step_7b_fp8"))
    out += drift_figures(steps.get("bench_fp8_drift"))
    out += synthetic_figures(steps.get("rl_synthetic"), steps.get("rl_synthetic_resumed"))
    out += critic_figures(steps.get("rl_synthetic_grpo"), steps.get("rl_synthetic_ppo"))
    out += e2e_figures("colocated (ipc, sleep/wake, optimizer offload)", steps.get("rl_colocated"), BF16_SYNC_BOUND)
    out += e2e_figures("separate engines (NCCL broadcast)", steps.get("rl_broadcast"), BF16_SYNC_BOUND)
    out += e2e_figures("FP8 trainer", steps.get("rl_fp8"), FP8_SYNC_BOUND)
    return out


def changes(current: list[dict], baseline: list[dict]) -> list[dict]:
    """Per figure present in both with a number: old, new and the relative change."""
    old = {f["name"]: f["value"] for f in baseline if isinstance(f.get("value"), (int, float))}
    out = []
    for f in current:
        if isinstance(f.get("value"), (int, float)) and f["name"] in old:
            before = old[f["name"]]
            rel = (f["value"] - before) / abs(before) if before else None
            out.append({"name": f["name"], "old": before, "new": f["value"], "change": rel})
    return out


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:.4g}{unit if unit == 'x' else ''}"
    return str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def render(results: dict, baseline: dict | None = None) -> tuple[str, dict]:
    """``(report.md text, report.json object)``."""
    figs = figures(results)
    env = results.get("environment", {})
    steps = results.get("steps", {})
    md = ["# make gpu-check", ""]
    md += [f"Run {results.get('started', '?')}, {results.get('seconds', 0):.0f} s in all.", "", "## Environment", ""]
    md += ["| what | value |", "|---|---|"]
    md += [f"| {k} | {_cell(v if v is not None else 'absent')} |" for k, v in env.items()]
    md += ["", "## Targets", "", "| figure | value | target | verdict | note |", "|---|---|---|---|---|"]
    for f in figs:
        verdict = {True: "pass", False: "FAIL", None: "-" if f["value"] is not None else "not measured"}[f["ok"]]
        md.append(f"| {f['name']} | {_fmt(f['value'], f['unit'])} | {f['target']} | {verdict} | {_cell(f['note'])} |")
    tests = steps.get("gpu_tests", {}).get("tests", [])
    md += ["", "## gpu-marked tests", ""]
    problem = _step_problem(steps.get("gpu_tests"))
    if not tests:
        md.append(f"No per-test results: {problem or 'the run collected none'}.")
    else:
        counts = {s: sum(t["status"] == s for t in tests) for s in ("passed", "failed", "skipped", "error")}
        md += [", ".join(f"{n} {s}" for s, n in counts.items()), "", "| test | status | reason |", "|---|---|---|"]
        md += [f"| {t['id']} | {t['status']} | {_cell(t.get('reason', ''))[:200]} |" for t in tests]
    md += ["", "## Steps", "", "| step | status | seconds | reason |", "|---|---|---|---|"]
    for name, s in steps.items():
        md.append(f"| {name} | {s.get('status')} | {s.get('seconds', 0):.0f} | {_cell(s.get('reason', ''))[:200]} |")
    diff = changes(figs, baseline.get("figures", [])) if baseline else []
    if baseline is not None:
        md += ["", f"## Change vs baseline ({baseline.get('started', '?')})", ""]
        md += ["| figure | old | new | change |", "|---|---|---|---|"]
        for c in diff:
            rel = "-" if c["change"] is None else f"{c['change']:+.1%}"
            md.append(f"| {c['name']} | {c['old']:.4g} | {c['new']:.4g} | {rel} |")
    md += ["", "## Benchmark output", ""]
    for name, s in steps.items():
        if s.get("stdout") and name != "gpu_tests":
            md += [f"### {name}", "", "```", s["stdout"].strip()[-6000:], "```", ""]
    report = {
        "started": results.get("started"),
        "seconds": results.get("seconds"),
        "environment": env,
        "figures": figs,
        "tests": tests,
        "steps": {k: {kk: vv for kk, vv in v.items() if kk not in ("stdout", "metrics")} for k, v in steps.items()},
        "changes": diff,
    }
    return "\n".join(md) + "\n", report


def write_report(results: dict, out_dir: Path, baseline: dict | None = None) -> tuple[Path, Path]:
    """Write ``out_dir/report.md`` and ``out_dir/report.json``; returns their paths."""
    text, report = render(results, baseline)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "report.md", out_dir / "report.json"
    md.write_text(text, encoding="utf-8")
    js.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return md, js


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="results.json of a gpu_check.py run")
    ap.add_argument("--out", type=Path, default=None, help="folder for report.md/json (default: beside results)")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier report.json: print every figure's change")
    args = ap.parse_args(argv)
    results = json.loads(args.results.read_text(encoding="utf-8"))
    baseline = json.loads(args.baseline.read_text(encoding="utf-8")) if args.baseline else None
    md, _ = write_report(results, args.out or args.results.parent, baseline)
    print(md.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
