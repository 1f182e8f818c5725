"""PACS's ``grpo`` estimator divides group-centred scores by their std (+1e-6). With ``log_ratio`` the first
mini-batch has pi == pi_old, so the std is 0 or rounding noise and the gradient is amplified up to 1e6-fold
(docs/algorithm.md §3.2). The arithmetic stays the reference's; groups whose score std is below 1e-4 are counted
in ``pacs/degenerate_std_groups`` (share of groups) and a warning is logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_pacs.algo import pacs
from megatron_pacs.algo.metrics import reduce_metrics
from megatron_pacs.algo.objectives import MiniBatch, PacsTwoPhase
from megatron_pacs.algo.pacs import DEGENERATE_STD, degenerate_std_metrics, pacs_loss, warn_degenerate_std
from megatron_pacs.config import LossConfig

KEY = "pacs/degenerate_std_groups"
N = 4


def _scores():
    """Three groups of 4: noise-level (std ~1e-7), exactly equal (std 0), and a real spread (std ~1)."""
    noise = torch.tensor([1e-7, -1e-7, 2e-7, 0.0], dtype=torch.float64)
    return torch.cat([noise, torch.zeros(N, dtype=torch.float64), torch.tensor([0.5, -1.0, 2.0, 0.1])])


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "grpo_no_std", "naive"])
def test_only_the_std_dividing_estimator_counts_degenerate_groups(advantage):
    m = degenerate_std_metrics(_scores(), group_size=N, advantage=advantage)
    if advantage == "grpo":
        assert reduce_metrics([m])[KEY] == pytest.approx(2 / 3)
    else:
        assert m == {}


def test_threshold_is_on_the_unbiased_group_std():
    below = torch.tensor([0.0, 0.0, 0.0, 0.99e-4 * 2], dtype=torch.float64)  # unbiased std 0.99e-4
    above = torch.tensor([0.0, 0.0, 0.0, 1.01e-4 * 2], dtype=torch.float64)
    assert below.std() < DEGENERATE_STD < above.std()
    m = degenerate_std_metrics(torch.cat([below, above]), group_size=N, advantage="grpo")
    assert m[KEY].tolist() == [1.0, 2.0]


def test_pacs_loss_reports_it_and_keeps_the_reference_arithmetic():
    s = _scores()
    rewards = torch.tensor([1, 0, 0, 1] * 3, dtype=torch.float64)
    seq = s.clone().requires_grad_()
    out = pacs_loss(seq, torch.zeros_like(s), rewards, group_size=N, advantage="grpo", weights="none")
    assert reduce_metrics([out.metrics])[KEY] == pytest.approx(2 / 3)
    # the arithmetic is unchanged: (s - mean) / (std + 1e-6)
    s_GN = s.view(-1, N)
    adv = ((s_GN - s_GN.mean(-1, keepdim=True)) / (s_GN.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    expect = torch.nn.functional.binary_cross_entropy_with_logits(adv, rewards, reduction="sum")
    torch.testing.assert_close(out.loss_sum, expect)
    assert KEY not in pacs_loss(seq, torch.zeros_like(s), rewards, group_size=N, advantage="rloo").metrics


def test_fresh_two_phase_first_mini_batch_is_all_degenerate():
    """The first mini-batch of a log_ratio run has s = 0 exactly in every group: all of them are counted."""
    obj = PacsTwoPhase(LossConfig(pacs_advantage="grpo"))
    rewards = torch.tensor([1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.float32)
    mb = MiniBatch(rows=torch.arange(8), rewards=rewards, response_lens=torch.full((8,), 3), group_size=N, fresh=True)
    metrics = reduce_metrics([obj.prepare(mb).metrics])
    assert metrics[KEY] == 1.0
    obj = PacsTwoPhase(LossConfig(pacs_advantage="rloo"))
    assert KEY not in reduce_metrics([obj.prepare(mb).metrics])


def test_warning_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(pacs, "_warned_degenerate_std", False)
    logger = logging.getLogger("megatron_pacs")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="megatron_pacs"):
        warn_degenerate_std({"pacs/loss": 0.3})  # estimator does not divide by the std: nothing
        warn_degenerate_std({KEY: 0.0})
        assert not caplog.records
        warn_degenerate_std({KEY: 0.5})
        warn_degenerate_std({KEY: 1.0})
    warnings = [r for r in caplog.records if "degenerate_std_groups" in r.getMessage()]
    assert len(warnings) == 1
    assert "1e-06" in warnings[0].getMessage() or "1e-6" in warnings[0].getMessage()
