"""The math-verify reward with the reference semantics (docs/algorithm.md §8.2).

The gold answer is wrapped as ``\\boxed{gt}`` and parsed with a LaTeX extractor; the response is parsed with
expression and LaTeX extractors; the score is 1.0 if math-verify finds them equivalent, else 0.0. Any error gives
0.0. Unlike the reference, the verifier is built once per process, not once per call.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from megatron_pacs.data.formats import normalize_ground_truth
from megatron_pacs.utils.logging import get_logger

__all__ = ["VERIFY_TIMEOUT", "math_verify_reward", "score_with_status"]

OK, ERROR, TIMEOUT, TOO_LONG = "ok", "error", "timeout", "too_long"
VERIFY_TIMEOUT = "verify_timeout"
"""Scored 0 because math-verify's own time limit (~5 s per parse or comparison) stopped it."""


class _TimeoutCounter(logging.Handler):
    """math-verify reports its own time limits only as a ``Timeout during ...`` warning and scores 0: count them.

    The handler takes every record of the ``math_verify`` loggers (which stop propagating): the rest are dropped,
    since math-verify logs every unparsable prediction in full (a 1 MB response would be a 1 MB log line), except
    errors, which go on to this project's logger.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("Timeout during"):
            self.count += 1
        elif record.levelno >= logging.ERROR:
            get_logger("rewards").error("math-verify: %s", record.getMessage()[:500])


_timeouts = _TimeoutCounter()


@lru_cache(maxsize=1)
def _verifier():
    mv_log = logging.getLogger("math_verify")
    mv_log.setLevel(logging.WARNING)
    mv_log.propagate = False
    mv_log.addHandler(_timeouts)
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    return math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )


def score_with_status(response: Any, ground_truth: Any) -> tuple[float, str]:
    """Score one response and say how it went.

    Returns:
        ``(score, status)`` with status ``"ok"``, ``"error"`` (non-string response, bad ground truth, or an
        exception inside math-verify) or ``"verify_timeout"`` (scored 0 after math-verify's own time limit cut a
        parse or a comparison short).
    """
    if not isinstance(response, str):
        return 0.0, ERROR
    try:
        gold = "\\boxed{" + normalize_ground_truth(ground_truth) + "}"
        verifier = _verifier()
        before = _timeouts.count
        score, _ = verifier([gold], [response])
    except Exception:  # noqa: BLE001 - the reference semantics: any failure scores 0
        return 0.0, ERROR
    if score > 0.5:
        return 1.0, OK
    return 0.0, (VERIFY_TIMEOUT if _timeouts.count > before else OK)


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
