"""Asynchronous rollouts through the real trainer (fleet, scorer, Megatron; fp32 on CPU), from the golden
fixture's model: ``--max-staleness 2 --partial-rollouts --filter-groups zero-variance --deterministic-mode``.

What is guarded:

- *repeatable asynchrony*: a run stopped after step 1 and resumed twice (steps 2 and 3, each from the previous
  checkpoint's stream: finished, partial and pending groups, counters, the prompt position) trains bit for bit as
  the uninterrupted run, and its dumps (tokens, per-token versions) are the same bytes;
- *several trainer ranks*: the second resume runs on two data-parallel ranks (the stream on the driver, its groups
  distributed, every rank in the drain, sync and save): the same rollouts bit for bit, the update to fp32 rounding;
- *no prompt lost*: every prompt drawn is trained once, filtered once, or still in the last checkpoint's stream;
- *replay*: the uninterrupted run's dumps replay bit for bit with ``--rollout-source replay``, with Ray, vLLM and
  math-verify absent;
- the staleness budget and the stream's metrics.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GOLDEN = Path(__file__).parent / "golden"
K = 2
COMMON = ["--train-iters", "3", "--max-response-length", "24", "--deterministic-mode", "--off-policy-correction", "tis"]
STREAM = ["--max-staleness", str(K), "--partial-rollouts", "--rollout-round-tokens", "5"]
STREAM += ["--filter-groups", "zero-variance"]
KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm", "pacs/loss", "rollout/staleness_token_mean")


def prepare(root: Path) -> Path:
    """The golden model, and its 16 training problems 6 times over under new ids (no epoch ends in 3 steps)."""
    import json

    shutil.copytree(GOLDEN / "model", root / "model")
    rows = [json.loads(line) for line in (GOLDEN / "train.jsonl").read_text().splitlines()]
    with open(root / "train.jsonl", "w") as f:
        for copy in range(6):
            for row in rows:
                f.write(json.dumps({**row, "id": f"{row['id']}-{copy}"}) + "\n")
    return root


def _train(root: Path, name: str, *flags: str, replay: bool = False, world: int = 1) -> list[dict]:
    base = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl")]
    base += [*(TINY_TRAIN_FLAGS if replay else TINY_RUN_FLAGS), *COMMON]
    history = run_train([*base, *flags], log_dir=root / name, cwd=root, without_fleet_stack=replay, world=world)
    return [m for m in history if "train/loss" in m]


def _launch(root: Path) -> dict:
    """The uninterrupted run (a checkpoint every step), the run stopped after step 1 and resumed twice (the second
    time on two data-parallel ranks), and the replay of the uninterrupted run's dumps; each run's steps by its name,
    and ``root``."""
    ckpt = ["--save-interval", "1", "--keep-last", "3"]
    out = {"whole": _train(root, "whole", *STREAM, "--save", str(root / "whole_ckpt"), *ckpt)}
    first = root / "whole_ckpt" / "iter_0000001"  # what a run stopped after step 1 saved
    out["second"] = _train(
        root, "second", *STREAM, "--load", str(first), "--train-iters", "2", "--save", str(root / "r")
    )
    out["third"] = _train(root, "third", *STREAM, "--load", str(root / "r"), "--save", str(root / "r"), world=2)
    out["replay"] = _train(
        root, "replay", "--rollout-source", "replay", "--replay-from", str(root / "whole"), replay=True
    )
    return {**out, "root": root}


LAUNCHES = {"stream": partial(_launch)}


@pytest.fixture(scope="module")
def runs(launched) -> dict:
    return launched["stream"].result()


def _dump(root: Path, run: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / run / "rollouts" / f"step_{step:06d}.safetensors"))


def test_a_run_resumed_twice_trains_and_samples_bit_for_bit_as_the_uninterrupted_run(runs):
    """Step 3, on two data-parallel ranks, samples the same tokens and rewards bit for bit; its update is the same
    arithmetic split across two ranks (the loss and gradient norm to fp32 rounding, as in tests/test_resume.py)."""
    whole = runs["whole"]
    resumed = [whole[0], *runs["second"], *runs["third"]]
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(whole[:2], resumed[:2], strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, a["step"]
    a, b = whole[2], resumed[2]
    for key in ("rollout/reward_mean", "rollout/staleness_token_mean", "rollout/num_tokens"):
        assert a[key] == b[key], key
    for key in ("train/loss", "train/grad_norm", "pacs/loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for a, b in zip(whole, resumed, strict=True):  # the stream's deltas at each resume's first step (issue 53, item 7)
        for key in ("rollout/stream_rounds", "rollout/filtered_groups", "rollout/dropped_groups"):
            assert a[key] == b[key], (a["step"], key)
    for run, step in (("second", 2), ("third", 3)):
        a, b = _dump(runs["root"], "whole", step), _dump(runs["root"], run, step)
        assert sorted(a) == sorted(b) and "token_versions" in a
        assert all(torch.equal(a[k], b[k]) for k in a), (run, step)


def test_every_prompt_drawn_is_trained_filtered_or_kept_once(runs):
    import json

    trained = []
    for run, step in (("whole", 1), ("second", 2), ("third", 3)):
        rows = (json.loads(line) for line in open(runs["root"] / run / "rollouts" / f"step_{step:06d}.jsonl"))
        trained += list(dict.fromkeys(r["id"] for r in rows))  # one id per group, in order
    assert len(trained) == len(set(trained)) == 12  # 3 steps x 4 groups, none twice
    last = torch.load(runs["root"] / "r" / "iter_0000003" / "pending_rollouts.pt", weights_only=False)
    meta = json.loads((runs["root"] / "r" / "iter_0000003" / "megatron_pacs.json").read_text())
    counters = last["stream"]["counters"]
    live = [g.row.id for g in last["stream"]["groups"]]
    assert not set(live) & set(trained)
    filtered = sum(m["rollout/filtered_groups"] for m in runs["whole"])
    assert counters.filtered == filtered > 0 and counters.dropped == 0
    assert counters.admitted == len(trained) + counters.filtered + len(live)
    assert meta["loader"]["position"] == counters.admitted == last["loader"]["position"]
    assert meta["world_size"] == 2  # saved by the two-rank resume


def test_the_dumps_replay_bit_for_bit_without_the_fleet_stack(runs):
    for a, b in zip(runs["whole"], runs["replay"], strict=True):
        assert {k: a[k] for k in KEYS[:4]} == {k: b[k] for k in KEYS[:4]}, a["step"]


def test_staleness_stays_within_the_budget_and_is_reported(runs):
    whole = runs["whole"]
    most = [m["rollout/staleness_token_max"] for m in whole]
    assert most[0] == 0.0 and 1.0 <= max(most) <= K  # steps after the first train on older weights, within K
    for m in whole:
        assert m["rollout/staleness_group_max"] <= K and m["rollout/policy_lag"] <= K
        assert m["rollout/stream_rounds"] >= 0 and m["rollout/queue_depth"] >= 0
        assert 0 <= m["perf/time/idle_engines"] <= m["perf/time/step"]
        assert 0 <= m["perf/time/idle_trainer"] <= m["perf/time/step"]
    assert whole[0]["rollout/stream_rounds"] > 0
