"""--filter-groups zero-variance with the synthetic source, the prompt loader and the producer, the way the trainer's
step drives them (synchronous and one step off): every step trains --global-batch-size groups with unequal rewards,
the dropped groups and refill rounds are counted, every prompt drawn is trained once or dropped once (none skipped,
none repeated), a resume from the loader's saved position continues the same prompt stream, and a step that cannot
fill its batch fails naming --max-filter-rounds."""

import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.data.loader import PromptLoader
from megatron_pacs.data.prompts import PromptRow
from megatron_pacs.producer import RolloutProducer
from megatron_pacs.sources import SyntheticSource
from megatron_pacs.sources.filtering import GroupFilter, zero_variance_groups

ROWS = [
    PromptRow(id=f"p{i}", data_source="t", prompt=[{"role": "user", "content": "q"}], ground_truth="0", question="q")
    for i in range(400)
]
GROUPS = 8


def _cfg(rate: float = 0.8, *extra: str):
    flags = ["--rollout-source", "synthetic", "--synthetic-reward-rate", str(rate), "--group-size", "4"]
    flags += ["--global-batch-size", str(GROUPS), "--ppo-mini-batch-size", "4", "--max-prompt-length", "64"]
    flags += ["--max-response-length", "32", "--filter-groups", "zero-variance", *extra]
    return parse_config(flags)


class Drawn:
    """The loader's ``next_batch``, recording every prompt drawn."""

    def __init__(self, loader: PromptLoader) -> None:
        self.loader, self.ids = loader, []

    def __call__(self, size: int | None = None) -> list[PromptRow]:
        rows = self.loader.next_batch(size)
        self.ids += [row.id for row in rows]
        return rows


def _producer(cfg) -> RolloutProducer:
    source = SyntheticSource(cfg, vocab_size=100)
    return RolloutProducer(source.collect, engines=False, group_filter=GroupFilter.from_config(cfg))


def _steps(producer, draw, steps: range, *, off: bool, train_iters: int = 5, pending: int | None = None) -> list:
    """Trainer.step's calls to the loader and the producer; each step's rollouts and the loader's position after it
    (what a checkpoint of the step saves: one step off, past the next step's prompts and refills)."""
    out = []
    for step in steps:
        ahead = pending == step
        rows = None if ahead else draw()
        pending = None
        gen = producer.rollouts(rows, step, step - 1, refill=draw)
        if off and step < train_iters:
            pending = step + 1
            producer.ahead(draw(), step + 1, step, refill=draw)
        producer.drain()
        out.append((gen.rollouts, draw.loader.state_dict()))
    return out


@pytest.mark.parametrize("off", [False, True], ids=["sync", "one_step_off"])
def test_every_step_trains_a_full_batch_and_each_prompt_is_used_once(off):
    cfg = _cfg()
    draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
    producer = _producer(cfg)
    try:
        steps = _steps(producer, draw, range(1, 6), off=off)
    finally:
        producer.close()
    trained: list[str] = []
    filtered = 0
    for rollouts, _ in steps:
        batch = rollouts.batch
        assert batch.num_prompts == GROUPS and len(rollouts.prompt_ids) == GROUPS
        assert batch.num_responses == GROUPS * 4 and len(rollouts.finish_reasons) == GROUPS * 4
        assert int(batch.offsets[-1]) == batch.token_ids.numel() == int(batch.lengths.sum())
        assert not zero_variance_groups(batch.rewards, 4).any()
        m = rollouts.metrics
        assert m["rollout/reward_mean"] == pytest.approx(float(batch.rewards.mean()))
        assert m["rollout/filter_rounds"] >= (m["rollout/filtered_groups"] > 0)
        filtered += int(m["rollout/filtered_groups"])
        trained += rollouts.prompt_ids
    assert filtered > 0  # the reward rate leaves many groups all-correct
    assert len(set(trained)) == len(trained)  # none trained twice
    assert len(draw.ids) == len(set(draw.ids)) == len(trained) + filtered  # each drawn prompt trained or dropped
    assert [i for i in draw.ids if i in set(trained)] == trained  # in the stream's order
    stream = PromptLoader(ROWS, GROUPS, seed=0).next_batch  # the refills are the stream's next prompts
    assert [r.id for _ in range(len(draw.ids) // GROUPS + 1) for r in stream()][: len(draw.ids)] == draw.ids


def test_a_resume_from_the_saved_position_continues_the_prompt_stream():
    """Stop after step 2 one step off (step 3's rollouts generated ahead, refills included, as a checkpoint keeps
    them with the loader's position), resume into a fresh loader and producer: the same prompts are trained, and the
    positions match, as in the continuous run."""
    cfg = _cfg()
    producer = _producer(cfg)
    head_producer = _producer(cfg)
    head_draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
    try:
        whole = _steps(producer, Drawn(PromptLoader(ROWS, GROUPS, seed=0)), range(1, 6), off=True)
        head = _steps(head_producer, head_draw, range(1, 3), off=True)
        saved, done = head_draw.loader.state_dict(), head_producer.done
    finally:
        producer.close()
        head_producer.close()
    assert done is not None and done.step == 3
    loader = PromptLoader(ROWS, GROUPS, seed=0)
    loader.load_state_dict(saved)
    resumed = _producer(cfg)
    resumed.done = done
    try:
        tail = _steps(resumed, Drawn(loader), range(3, 6), off=True, pending=3)
    finally:
        resumed.close()
    assert [r.prompt_ids for r, _ in head + tail] == [r.prompt_ids for r, _ in whole]
    assert [pos for _, pos in head + tail] == [pos for _, pos in whole]
    assert sum(r.metrics["rollout/filtered_groups"] for r, _ in whole) > 0


def test_refill_rounds_draw_new_rewards_and_a_batch_that_cannot_fill_fails_naming_the_flag():
    source = SyntheticSource(_cfg(), vocab_size=100)
    rows = ROWS[:GROUPS]
    a, b = source.collect(rows, 1), source.collect(rows, 1, refill=1)
    assert torch.equal(a.batch.rewards, source.collect(rows, 1).batch.rewards)  # round 0: the unfiltered stream
    assert not torch.equal(a.batch.rewards, b.batch.rewards)
    cfg = _cfg(1.0, "--max-filter-rounds", "2")  # every response right: every group has zero variance
    draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
    producer = _producer(cfg)
    try:
        with pytest.raises(
            RuntimeError, match=r"step 1: --filter-groups zero-variance: 0 of 8 .*--max-filter-rounds 2"
        ):
            producer.rollouts(draw(), 1, 0, refill=draw)
    finally:
        producer.close()
    assert len(draw.ids) == 3 * GROUPS  # the step's prompts and two refill rounds of the 8 missing
