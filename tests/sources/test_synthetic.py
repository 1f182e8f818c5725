"""The synthetic source: the run's batch shape, lengths within the limits with a long tail, the reward rate, and
rollouts that depend only on --seed and the step."""

import numpy as np
import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.sources import SyntheticSource
from megatron_pacs.sources.synthetic import synthetic_lengths


def _rows(n: int) -> list[PromptRow]:
    return [
        PromptRow(
            id=f"r{i}", data_source="t", prompt=[{"role": "user", "content": "q"}], ground_truth="0", question="q"
        )
        for i in range(n)
    ]


def _source(*argv: str) -> SyntheticSource:
    flags = ["--rollout-source", "synthetic", "--global-batch-size", "8", "--group-size", "4"]
    flags += ["--ppo-mini-batch-size", "4", "--max-prompt-length", "300", "--max-response-length", "2048"]
    return SyntheticSource(parse_config([*flags, *argv]), vocab_size=1000)


def test_the_batch_has_the_runs_shape_and_its_lengths_stay_within_the_limits():
    rollouts = _source().collect(_rows(8), 1)
    batch = rollouts.batch
    assert batch.num_responses == 32 and batch.group_size == 4 and rollouts.prompt_ids == [f"r{i}" for i in range(8)]
    assert int(batch.prompt_lens.min()) >= 64 and int(batch.prompt_lens.max()) <= 300
    assert int(batch.response_lens.min()) >= 1 and int(batch.response_lens.max()) <= 2048
    assert int(batch.token_ids.min()) >= 3 and int(batch.token_ids.max()) < 1000
    assert batch.engine_logprobs is None  # no engine: no consistency check, no importance weights
    assert set(batch.rewards.tolist()) <= {0.0, 1.0}
    assert rollouts.metrics["rollout/num_tokens"] == float(batch.lengths.sum())


def test_responses_are_log_normal_with_a_long_tail_up_to_the_limit():
    mix = synthetic_lengths(np.random.default_rng(0), 512, 8, max_prompt=512, max_response=8192)
    responses = np.array([r for _, r in mix])
    assert 1200 < np.median(responses) < 1800  # bench_train_step.py's median of 1,500
    assert responses.max() == 8192 and (responses == 8192).mean() < 0.05  # the tail reaches the cap, rarely


@pytest.mark.parametrize("rate", [0.0, 0.25, 1.0])
def test_rewards_are_one_at_the_chosen_rate(rate):
    rewards = torch.cat(
        [_source("--synthetic-reward-rate", str(rate)).collect(_rows(8), s).batch.rewards for s in range(20)]
    )
    assert abs(float(rewards.mean()) - rate) < 0.06


def test_a_step_depends_only_on_the_seed_and_the_step():
    a, b = _source().collect(_rows(8), 3), _source().collect(_rows(8), 3)
    assert torch.equal(a.batch.token_ids, b.batch.token_ids) and torch.equal(a.batch.rewards, b.batch.rewards)
    assert not torch.equal(_source().collect(_rows(8), 4).batch.token_ids[:50], a.batch.token_ids[:50])
    assert not torch.equal(_source("--seed", "2").collect(_rows(8), 3).batch.token_ids[:50], a.batch.token_ids[:50])
