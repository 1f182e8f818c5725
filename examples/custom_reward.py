"""A reward of your own for ``--reward-fn`` (docs/training.md, "Your own reward").

Train with it::

    .venv/bin/python -m megatron_pacs.train ... --reward-fn examples/custom_reward.py:boxed_reward

Each reward worker imports this file and calls ``fn(response, ground_truth)`` with the decoded response (prompt
excluded) and the row's ``ground_truth``; the function returns a number in [0, 1]. It runs under
``--reward-timeout`` per response; a function that raises, returns something else or runs past the time-out
scores 0 and is counted (``reward/num_errors``, ``reward/num_timeouts``).
"""

import re

from megatron_pacs.rewards import math_verify_reward

BOXED = re.compile(r"\\boxed\{")

FORMAT_CREDIT = 0.1
"""What a wrong answer stated in the asked-for format (one ``\\boxed{...}``) earns."""
LENGTH_BUDGET = 2000
"""Characters a correct response may use before its reward shrinks."""


def boxed_reward(response: str, ground_truth: str) -> float:
    """1 for a correct answer in exactly one ``\\boxed{}``, shrinking past :data:`LENGTH_BUDGET` characters (to 0.5 at
    twice the budget); :data:`FORMAT_CREDIT` for one ``\\boxed{}`` with a wrong answer; 0 without one.

    Args:
        response: The model's response text.
        ground_truth: The final answer, e.g. ``"27"`` or ``"\\frac{1}{2}"``.

    Returns:
        A score in [0, 1].
    """
    if len(BOXED.findall(response)) != 1:
        return 0.0
    if not math_verify_reward(response, ground_truth):
        return FORMAT_CREDIT
    excess = max(0, len(response) - LENGTH_BUDGET)
    return max(FORMAT_CREDIT, 1.0 - 0.5 * excess / LENGTH_BUDGET)
