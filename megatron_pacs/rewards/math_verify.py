"""The math-verify reward with the reference semantics (docs/algorithm.md §8.2).

The gold answer is wrapped as ``\\boxed{gt}`` and parsed with a LaTeX extractor; the response is parsed with
expression and LaTeX extractors; the score is 1.0 if math-verify finds them equivalent, else 0.0. Any error gives
0.0. Unlike the reference, the verifier is built once per process, not once per call.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from megatron_pacs.data.formats import normalize_ground_truth

__all__ = ["math_verify_reward", "score_with_status"]

OK, ERROR, TIMEOUT, TOO_LONG = "ok", "error", "timeout", "too_long"


@lru_cache(maxsize=1)
def _verifier():
    import logging

    # math-verify logs every unparsable prediction in full at WARNING (a 1 MB response becomes a 1 MB log line).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    return math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )


def score_with_status(response: Any, ground_truth: Any) -> tuple[float, str]:
    """Score one response and say how it went.

    Returns:
        ``(score, status)`` with status ``"ok"`` or ``"error"`` (non-string response, bad ground truth, or an
        exception inside math-verify, including its own internal time limits).
    """
    if not isinstance(response, str):
        return 0.0, ERROR
    try:
        gold = "\\boxed{" + normalize_ground_truth(ground_truth) + "}"
        score, _ = _verifier()([gold], [response])
    except Exception:  # noqa: BLE001 - the reference semantics: any failure scores 0
        return 0.0, ERROR
    return (1.0 if score > 0.5 else 0.0), OK


def math_verify_reward(response: str, ground_truth: str) -> float:
    """1.0 if ``response`` states an answer equivalent to ``ground_truth``, else 0.0 (errors give 0.0).

    Runs in the calling process with math-verify's own signal-based time limits only. For batches, untrusted
    or pathological inputs, use :class:`megatron_pacs.rewards.RewardScorer`, which enforces a hard timeout.

    Args:
        response: The decoded model response (prompt excluded).
        ground_truth: The final answer, e.g. ``"\\frac{1}{2}"`` or ``"27"`` (wrapped in ``\\boxed{}`` here).

    Returns:
        0.0 or 1.0.
    """
    return score_with_status(response, ground_truth)[0]
