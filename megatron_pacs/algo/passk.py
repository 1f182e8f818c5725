"""Unbiased pass@k (Chen et al. 2021), docs/algorithm.md §8.3."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["pass_at_k", "pass_at_k_curve", "powers_of_two_up_to"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct.

    Computes ``1 - C(n-c, k) / C(n, k)`` as ``1 - prod_{i=n-c+1..n} (1 - k/i)``: a product of c factors in
    (0, 1], stable for any n (no factorials, no overflow).

    Args:
        n: Samples drawn for the problem (>= 1).
        c: Correct samples among them (0 <= c <= n).
        k: The k in pass@k (1 <= k <= n).

    Returns:
        pass@k in [0, 1].
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (samples per problem)")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must lie in [0, n={n}] (correct samples)")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must lie in [1, n={n}]; draw at least k samples per problem")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def powers_of_two_up_to(n: int) -> list[int]:
    """``[1, 2, 4, ...]`` up to and including the largest power of two <= n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def pass_at_k_curve(scores: Iterable[Sequence[float]], ks: Sequence[int] | None = None) -> dict[str, float]:
    """Mean pass@k over problems.

    Args:
        scores: Per problem, its samples' 0/1 scores (> 0.5 counts as correct). Every problem needs >= max(ks).
        ks: The k values; default powers of two up to the smallest per-problem sample count.

    Returns:
        ``{"pass@1": ..., "pass@2": ...}``.
    """
    per_problem = [(len(s), sum(1 for x in s if x > 0.5)) for s in scores]
    if not per_problem:
        raise ValueError("pass@k needs at least one problem with samples")
    n_min = min(n for n, _ in per_problem)
    ks = list(ks) if ks is not None else powers_of_two_up_to(n_min)
    if ks and max(ks) > n_min:
        raise ValueError(f"k={max(ks)} exceeds the {n_min} samples of some problem; sample more or lower k")
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in per_problem) / len(per_problem) for k in ks}
