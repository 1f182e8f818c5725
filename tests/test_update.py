"""The update's own arithmetic: truncated importance ratios against the engines' log-probs."""

import math

import pytest
import torch


def test_truncated_importance_ratios_at_sequence_and_token_level():
    """min(pi_anchor / pi_behaviour, cap), the behaviour being the engines' log-probs; sequence level multiplies the
    tokens' ratios (PACS), token level keeps them apart (GRPO); what has no engine log-prob counts as on-policy (a
    token at token level, its whole response at sequence level)."""
    from megatron_pacs.algo.objectives import Logprobs
    from megatron_pacs.algo.tokens import TokenStore
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.update import truncated_importance

    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 6, 7, 8, 9]]
    # responses' engine log-probs: 0 has a token without one; 1 is not held here; 2 is complete
    engine = torch.tensor([-1.0, float("nan"), -0.5, -1.0, -3.0, -0.7])
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor([2, 2, 2]), torch.tensor([2, 1, 3]), torch.zeros(3), 1, engine_logprobs=engine
    ).share([0, 2])  # this rank holds responses 0 and 2
    anchor_tokens = torch.tensor([-1.5, -1.0, -0.5, -2.0, -0.3, -1.0])  # all three responses' tokens
    offsets = torch.tensor([0, 2, 3, 6])
    anchor = Logprobs(
        seq=torch.tensor([-2.5, -0.5, -3.3], dtype=torch.float64), tokens=TokenStore(anchor_tokens, offsets)
    )
    seq, report = truncated_importance(anchor, batch, "sequence", high=2.0)
    # response 0: incomplete, on-policy (1); response 1: not held (1); response 2: exp(-3.3 - (-4.7)) = 4.06 -> 2.0
    assert seq.seq.tolist() == pytest.approx([1.0, 1.0, 2.0])
    assert report["offpolicy/is_truncated"].tolist() == [1.0, 2.0]
    assert report["offpolicy/is_ratio_mean"].tolist() == pytest.approx([1.0 + math.exp(1.4), 2.0])
    # geometric: the per-token geometric mean, exp(1.4 / 3) for response 2's three tokens (below the cap)
    geo, report = truncated_importance(anchor, batch, "geometric", high=2.0)
    assert geo.seq.tolist() == pytest.approx([1.0, 1.0, math.exp(1.4 / 3)])
    assert report["offpolicy/is_truncated"].tolist() == [0.0, 2.0]
    tok, _ = truncated_importance(anchor, batch, "token", high=2.0)
    assert tok.tokens is not None
    # response 0's tokens vs engine [-1, NaN]; response 1 is not held (1); response 2's vs engine [-1, -3, -0.7]
    expected = [math.exp(-0.5), 1.0, 1.0, math.exp(-2.0 + 1.0), math.exp(-0.3 + 3.0), math.exp(-1.0 + 0.7)]
    expected = [min(v, 2.0) for v in expected]
    assert tok.tokens.values.tolist() == pytest.approx(expected)


def test_masked_importance_weights_zero_the_ratios_outside_the_bounds():
    """--tis-mode mask: a response (sequence level) or token (token level) whose ratio leaves [low, high] weighs 0,
    the others their ratio; ``offpolicy/is_masked`` counts them; truncate at --tis-low 0 is min(ratio, high)."""
    from megatron_pacs.algo.objectives import Logprobs
    from megatron_pacs.algo.tokens import TokenStore
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.update import truncated_importance

    seqs = [[1, 2, 3, 4], [1, 2, 5, 6]]
    engine = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor([2, 2]), torch.tensor([2, 2]), torch.zeros(2), 1, engine_logprobs=engine
    )
    tokens = torch.tensor([-1.0, -3.0, -1.0, -0.4])  # token ratios 1, e^-2, e, e^0.1
    anchor = Logprobs(
        seq=torch.tensor([-4.0, -1.4], dtype=torch.float64), tokens=TokenStore(tokens, torch.tensor([0, 2, 4]))
    )
    seq, report = truncated_importance(anchor, batch, "sequence", mode="mask", low=0.5, high=2.0)
    # response 0: exp(-4 + 2) = e^-2 < 0.5 -> 0; response 1: exp(-1.4 + 2.5) = e^1.1 > 2 -> 0
    assert seq.seq.tolist() == [0.0, 0.0] and report["offpolicy/is_masked"].tolist() == [2.0, 2.0]
    assert "offpolicy/is_truncated" not in report
    tok, report = truncated_importance(anchor, batch, "token", mode="mask", low=0.5, high=2.0)
    assert tok.tokens is not None
    assert tok.tokens.values.tolist() == pytest.approx([1.0, 0.0, 0.0, math.exp(0.1)])
    assert report["offpolicy/is_masked"].tolist() == [2.0, 4.0]
    tok, report = truncated_importance(anchor, batch, "token", high=2.0)
    assert tok.tokens is not None
    assert tok.tokens.values.tolist() == pytest.approx([1.0, math.exp(-2.0), 2.0, math.exp(0.1)])
    assert report["offpolicy/is_truncated"].tolist() == [1.0, 4.0]
