"""pass@k against exact rational arithmetic, including n = 1024."""

from fractions import Fraction
from math import comb

import pytest

from megatron_pacs.algo import pass_at_k, pass_at_k_curve, powers_of_two_up_to


def exact(n, c, k):
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [
        (1, 0, 1),
        (1, 1, 1),
        (8, 3, 1),
        (8, 3, 4),
        (8, 7, 2),
        (32, 1, 32),
        (256, 5, 128),
        (1024, 1, 1),
        (1024, 3, 512),
        (1024, 17, 1024),
        (1024, 1000, 8),
        (1024, 0, 256),
        (1000, 999, 999),
    ],
)
def test_matches_exact_fraction(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), rel=1e-12, abs=1e-15)


def test_all_pairs_for_n_64():
    worst = max(abs(pass_at_k(64, c, k) - float(exact(64, c, k))) for c in range(65) for k in range(1, 65))
    assert worst < 1e-13


def test_pass1_is_accuracy_and_curve():
    scores = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    curve = pass_at_k_curve(scores)
    assert list(curve) == ["pass@1", "pass@2", "pass@4"]
    assert curve["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert curve["pass@4"] == pytest.approx(2 / 3)
    assert powers_of_two_up_to(1024)[-1] == 1024 and powers_of_two_up_to(7) == [1, 2, 4]


def test_errors():
    with pytest.raises(ValueError, match="k=9 must lie in"):
        pass_at_k(8, 1, 9)
    with pytest.raises(ValueError, match="c=9 must lie"):
        pass_at_k(8, 9, 1)
    with pytest.raises(ValueError, match="exceeds the 2 samples"):
        pass_at_k_curve([[1, 0], [1, 1, 1, 1]], ks=[4])
