"""The math-verify reward with real math-verify: equivalences, wrong and missing answers."""

import pytest

from megatron_pacs.data.formats import normalize_ground_truth
from megatron_pacs.rewards import math_verify_reward, score_with_status


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The total is \\boxed{27}", "27.0", 1.0),
        ("\\boxed{27.0}", "27", 1.0),
        ("\\boxed{25}", "025", 1.0),
        ("\\boxed{(3, -1)}", "(3, -1)", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{26}", "27", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("I am not sure.", "27", 0.0),
        ("", "27", 0.0),
    ],
)
def test_reward_cases(response, ground_truth, expected):
    assert math_verify_reward(response, ground_truth) == expected


def test_numeric_ground_truths_and_bad_inputs():
    assert math_verify_reward("\\boxed{27}", 27.0) == 1.0  # AMC stores floats
    assert math_verify_reward("\\boxed{204}", 204) == 1.0  # AIME 2024 stores ints
    assert normalize_ground_truth(27.0) == "27" and normalize_ground_truth(2.5) == "2.5"
    assert score_with_status(None, "1") == (0.0, "error")
    assert score_with_status(b"\\boxed{1}", "1") == (0.0, "error")
    assert score_with_status("\\boxed{1}", ["1"]) == (0.0, "error")
