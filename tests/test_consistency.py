"""Train/rollout consistency: the engines' vs the trainer's log-probs of the same tokens, and the bound on them."""

import pytest
import torch


def test_consistency_separates_fp8s_gap_from_a_sync_error():
    """With an FP8 trainer the engines are compared with a bf16 pass (a sync error shows there) and the FP8
    training pass with that bf16 pass (the precision's own gap), so a bound on the first is not tripped by FP8."""
    from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
    from megatron_pacs.consistency import with_consistency
    from megatron_pacs.data.batching import RolloutBatch

    engine = torch.tensor([-1.0, -2.0, -0.5])
    batch = RolloutBatch.from_sequences(
        [[1, 2, 3, 4], [1, 2, 5]], torch.tensor([2, 2]), torch.tensor([2, 1]), torch.zeros(2), 1, engine_logprobs=engine
    )
    bf16 = TokenStore(torch.tensor([-1.0, -2.0, -0.5]) + 1e-3, torch.tensor([0, 2, 3]))  # synced, bf16 rounding
    fp8_logp = torch.tensor([-1.2, -2.1, -0.45])  # the FP8 training pass: a larger gap
    tokens = TokenLogprobs(
        logp=fp8_logp,
        seq=torch.tensor([0, 0, 1]),
        rank=torch.tensor([0, 1, 0]),
        index=torch.tensor([0, 1]),
        lengths=torch.tensor([2, 1]),
        raw=fp8_logp,
    )

    def loss(t):
        return t.logp.sum(), torch.tensor(2), {}

    _, _, report = with_consistency(loss, batch, bf16)(tokens)
    assert report["consistency/logprob_abs_diff_max"][0].item() == pytest.approx(1e-3, rel=1e-3)
    assert report["consistency/fp8_gap_logprob_abs_diff_max"][0].item() == pytest.approx(0.201, rel=1e-3)
    assert report["consistency/fp8_gap_seq_logprob_abs_diff_max"][0].item() == pytest.approx(0.302, rel=1e-3)
    _, _, plain = with_consistency(loss, batch, None)(tokens)  # bf16 trainer: compared directly
    assert plain["consistency/logprob_abs_diff_max"][0].item() == pytest.approx(0.2, rel=1e-3)
    assert "consistency/fp8_gap_logprob_abs_diff_max" not in plain


def test_the_bound_stops_the_run_naming_the_step_the_difference_and_the_flag():
    from megatron_pacs.consistency import check_logprob_bound

    check_logprob_bound(None, {"sync/max_logprob_diff": 5.0}, 3)  # no bound: nothing is checked
    check_logprob_bound(0.1, {"consistency/logprob_abs_diff_max": 0.05, "sync/max_logprob_diff": 0.1}, 3)
    with pytest.raises(RuntimeError, match=r"step 3: .*sync probe.* up to 0\.5 > --max-logprob-diff 0\.1"):
        check_logprob_bound(0.1, {"sync/max_logprob_diff": 0.5}, 3)
    with pytest.raises(RuntimeError, match=r"step 7: .*the rollouts' tokens.* > --max-logprob-diff 0\.01"):
        check_logprob_bound(0.01, {"consistency/logprob_abs_diff_max": 0.02}, 7)
