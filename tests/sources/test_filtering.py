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
from megatron_pacs.utils.run_failure import RunFailure

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
    cfg = _cfg(0.8, "--max-filter-rounds", "2")
    cfg.source.synthetic_reward_rate = 1.0  # every response right (the config refuses it: tested below)
    draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
    producer = _producer(cfg)
    try:
        with pytest.raises(RunFailure, match=r"step 1: --filter-groups zero-variance: 0 of 8 .*--max-filter-rounds 2"):
            producer.rollouts(draw(), 1, 0, refill=draw)
    finally:
        producer.close()
    assert len(draw.ids) == 3 * GROUPS  # the step's prompts and two refill rounds of the 8 missing


@pytest.mark.parametrize("rate", ["0", "1"])
def test_a_synthetic_rate_that_leaves_no_group_is_refused(rate, capsys):
    """Issue 53, item 4: every synthetic reward equal (rate 0 or 1) made every step fail after its refill rounds (or,
    with --max-filter-rounds 0, spin for ever); the config refuses it, naming the flag."""
    with pytest.raises(SystemExit):
        _cfg(float(rate))
    assert f"--filter-groups: every reward is {rate} with --synthetic-reward-rate {rate}" in capsys.readouterr().err


def test_no_limit_says_that_the_step_is_still_refilling(caplog):
    """Issue 53, item 5: --max-filter-rounds 0 refilled silently for ever when no group could pass (150 s, 0 steps);
    the step now says it is still refilling after 8, 16, 32, ... rounds. The source's rewards are all 1 for 20
    refill rounds here, then mixed (in-process, about 0.1 s)."""
    cfg = _cfg(0.8, "--max-filter-rounds", "0")
    source = SyntheticSource(cfg, vocab_size=100)

    def collect(rows, step, *, refill=0):
        source.cfg.source.synthetic_reward_rate = 1.0 if refill < 20 else 0.8
        return source.collect(rows, step, refill=refill)

    draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
    with caplog.at_level("WARNING", logger="megatron_pacs.filtering"):
        out = GroupFilter.from_config(cfg)(collect, draw(), 1, draw)
    assert out.metrics["rollout/filter_rounds"] > 20 and out.batch.num_prompts == GROUPS
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" rounds")[0] for line in lines] == [
        f"step 1: --filter-groups zero-variance: still refilling after {n}" for n in (8, 16)
    ]
    assert "--max-filter-rounds 0: no limit" in lines[0]


def test_a_step_that_cannot_fill_ends_the_run_with_one_line(monkeypatch, capsys):
    """Issue 53, item 4: the filter's failure ended the run with a 30-line traceback that buried its message; the
    entry point (``python -m megatron_pacs.train``'s ``cli``) now prints the message as one line and exits 1. Its
    ``main`` is replaced by the filter's failing step (the synthetic source, in-process, about 0.1 s)."""
    import megatron_pacs.train as train

    def main(argv=None):
        cfg = _cfg(0.8, "--max-filter-rounds", "1")
        cfg.source.synthetic_reward_rate = 0.0
        source = SyntheticSource(cfg, vocab_size=100)
        draw = Drawn(PromptLoader(ROWS, GROUPS, seed=0))
        GroupFilter.from_config(cfg)(source.collect, draw(), 1, draw)

    monkeypatch.setattr(train, "main", main)
    assert train.cli([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: step 1: --filter-groups zero-variance: 0 of 8 groups have unequal rewards after 1 ")
    assert err.count("\n") == 1 and "Traceback" not in err
