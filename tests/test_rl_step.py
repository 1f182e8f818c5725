"""StepLayout: who trains which responses, padded (today's contiguous cuts, exactly) or packed (token-balanced
groups per data-parallel rank, the same number of micro-batches everywhere, one row shape under PP)."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_pacs.config import BatchConfig
from megatron_pacs.data.batching import RolloutBatch, micro_batch_rows, mini_batch_rows
from megatron_pacs.rl_step import StepLayout


def _batch(num_prompts: int, group_size: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    prompts = [rng.randint(8, 20) for _ in range(num_prompts)]
    seqs, plens, rlens = [], [], []
    for p in prompts:
        for _ in range(group_size):
            r = min(1 + int(rng.lognormvariate(3.0, 0.9)), 120)
            seqs.append(list(range(3, 3 + p + r)))
            plens.append(p)
            rlens.append(r)
    return RolloutBatch.from_sequences(
        seqs, torch.tensor(plens), torch.tensor(rlens), torch.zeros(len(seqs)), group_size
    )


def _groups(dp_rank: int = 0, dp_size: int = 1, pp_size: int = 1, vpp: int | None = None) -> SimpleNamespace:
    """The facts StepLayout reads from ParallelGroups (no process group is needed to plan a layout)."""
    config = SimpleNamespace(virtual_pipeline_model_parallel_size=vpp)
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, pp_size=pp_size, config=config)


def test_padded_layout_is_todays_contiguous_cut():
    batch = _batch(8, 4)
    cfg = BatchConfig(
        global_batch_size=8, group_size=4, ppo_mini_batch_size=4, micro_batch_size=3, sequence_packing=False
    )
    layout = StepLayout(batch, cfg, _groups(1, 2), whole_groups=False)  # type: ignore[arg-type]
    assert [layout.rows([m]) for m in range(2)] == mini_batch_rows(8, 4, 4, 1, 2)
    lengths = batch.lengths.tolist()
    parts = micro_batch_rows(layout.rows([0]), lengths, micro_batch_size=3)
    mbs = layout.micro_batches([0])
    assert [mb.sequence_index.tolist() for mb in mbs] == parts and not any(mb.packed for mb in mbs)


@pytest.mark.parametrize("pp_size", [1, 2])
@pytest.mark.parametrize("whole_groups", [False, True])
def test_packed_layout_covers_each_response_once_with_equal_micro_batch_counts(pp_size, whole_groups):
    batch = _batch(16, 4, seed=pp_size)
    cfg = BatchConfig(
        global_batch_size=16,
        group_size=4,
        ppo_mini_batch_size=8,
        micro_batch_size=4,
        max_prompt_length=20,
        max_response_length=120,
    )
    budget = cfg.packing_budget
    layouts = [StepLayout(batch, cfg, _groups(r, 4, pp_size), whole_groups=whole_groups) for r in range(4)]  # type: ignore[arg-type]
    for m in range(2):
        per_rank = [layout.micro_batches([m]) for layout in layouts]
        assert len({len(mbs) for mbs in per_rank}) == 1
        seen = sorted(int(i) for mbs in per_rank for mb in mbs for i in mb.sequence_index)
        assert seen == list(range(m * 32, (m + 1) * 32))
        for mbs in per_rank:
            fullest = max(mb.tokens.numel() - mb.num_padding for mb in mbs)
            for mb in mbs:
                assert mb.packed and mb.tokens.shape[0] == 1
                assert mb.tokens.shape[1] <= budget
                if pp_size > 1:  # one message shape per schedule: the fullest row's, no more
                    assert mb.tokens.shape[1] == fullest
                if whole_groups:
                    idx = mb.sequence_index.tolist()
                    assert len(idx) % 4 == 0 and all(idx[k] % 4 == 0 for k in range(0, len(idx), 4))
        # whole groups per rank, balanced: each rank's token total is within one group of the mean
        totals = [sum(int(batch.lengths[i]) for i in layouts[r].rows([m])) for r in range(4)]
        group_tokens = [sum(int(batch.lengths[i]) for i in range(g * 4, g * 4 + 4)) for g in range(16)]
        assert max(totals) - min(totals) <= max(group_tokens)


def test_interleaved_pipelining_gets_a_multiple_of_pp_micro_batches():
    batch = _batch(4, 2)
    cfg = BatchConfig(global_batch_size=4, group_size=2, ppo_mini_batch_size=4, max_tokens_per_microbatch=100_000)
    plain = StepLayout(batch, cfg, _groups(pp_size=4), whole_groups=False).micro_batches([0])  # type: ignore[arg-type]
    interleaved = StepLayout(batch, cfg, _groups(pp_size=4, vpp=2), whole_groups=False)  # type: ignore[arg-type]
    assert len(plain) == 1 and len(interleaved.micro_batches([0])) == 4


def test_alignment_rounds_every_micro_batch_up():
    batch = _batch(4, 2)
    for packing in (True, False):
        cfg = BatchConfig(
            global_batch_size=4, group_size=2, ppo_mini_batch_size=4, micro_batch_size=2, sequence_packing=packing
        )
        mbs = StepLayout(batch, cfg, _groups(), whole_groups=False, align=16).micro_batches([0])  # type: ignore[arg-type]
        assert all(mb.tokens.shape[1] % 16 == 0 for mb in mbs)


def test_a_group_larger_than_the_packed_budget_is_refused_at_configuration():
    with pytest.raises(ValueError, match="--max-tokens-per-microbatch: 2000 cannot hold a whole group of 8"):
        BatchConfig(keep_groups_in_microbatch=True, max_tokens_per_microbatch=2000, micro_batch_size=8)


def test_truncated_importance_ratios_at_sequence_and_token_level():
    """min(pi_anchor / pi_behaviour, cap), the behaviour being the engines' log-probs; sequence level multiplies the
    tokens' ratios (PACS), token level keeps them apart (GRPO); what has no engine log-prob counts as on-policy (a
    token at token level, its whole response at sequence level)."""
    from megatron_pacs.algo.objectives import Logprobs
    from megatron_pacs.algo.tokens import TokenStore
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.rl_step import truncated_importance

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
    seq, report = truncated_importance(anchor, batch, "sequence", cap=2.0)
    # response 0: incomplete, on-policy (1); response 1: not held (1); response 2: exp(-3.3 - (-4.7)) = 4.06 -> 2.0
    assert seq.seq.tolist() == pytest.approx([1.0, 1.0, 2.0])
    assert report["offpolicy/is_truncated"].tolist() == [1.0, 2.0]
    assert report["offpolicy/is_ratio_mean"].tolist() == pytest.approx([1.0 + math.exp(1.4), 2.0])
    # geometric: the per-token geometric mean, exp(1.4 / 3) for response 2's three tokens (below the cap)
    geo, report = truncated_importance(anchor, batch, "geometric", cap=2.0)
    assert geo.seq.tolist() == pytest.approx([1.0, 1.0, math.exp(1.4 / 3)])
    assert report["offpolicy/is_truncated"].tolist() == [0.0, 2.0]
    tok, _ = truncated_importance(anchor, batch, "token", cap=2.0)
    assert tok.tokens is not None
    # response 0's tokens vs engine [-1, NaN]; response 1 is not held (1); response 2's vs engine [-1, -3, -0.7]
    expected = [math.exp(-0.5), 1.0, 1.0, math.exp(-2.0 + 1.0), math.exp(-0.3 + 3.0), math.exp(-1.0 + 0.7)]
    expected = [min(v, 2.0) for v in expected]
    assert tok.tokens.values.tolist() == pytest.approx(expected)


def test_consistency_separates_fp8s_gap_from_a_sync_error():
    """With an FP8 trainer the engines are compared with a bf16 pass (a sync error shows there) and the FP8
    training pass with that bf16 pass (the precision's own gap), so a bound on the first is not tripped by FP8."""
    from megatron_pacs.algo.tokens import TokenLogprobs, TokenStore
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.rl_step import _with_consistency

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

    _, _, report = _with_consistency(loss, batch, bf16)(tokens)
    assert report["consistency/logprob_abs_diff_max"][0].item() == pytest.approx(1e-3, rel=1e-3)
    assert report["consistency/fp8_gap_logprob_abs_diff_max"][0].item() == pytest.approx(0.201, rel=1e-3)
    assert report["consistency/fp8_gap_seq_logprob_abs_diff_max"][0].item() == pytest.approx(0.302, rel=1e-3)
    _, _, plain = _with_consistency(loss, batch, None)(tokens)  # bf16 trainer: compared directly
    assert plain["consistency/logprob_abs_diff_max"][0].item() == pytest.approx(0.2, rel=1e-3)
    assert "consistency/fp8_gap_logprob_abs_diff_max" not in plain
