"""The field's objectives train for real from the command line: GSPO, CISPO and GRPO's DAPO and Dr. GRPO settings,
each advantage estimator and aggregation mode, the entropy bonus and DAPO's overlong shaping.

Tiny launches of ``python -m megatron_pacs.train`` (2 steps, 2 optimizer steps each): three without the fleet
(``--rollout-source synthetic``; GSPO at two data-parallel ranks, where token- and sequence-mean normalisers span
both ranks' responses), DAPO with the fleet (the real engines, reward pool and dynamic sampling) GSPO with the
fleet and the off-policy correction (its geometric-mean importance ratio against the engines' log-probs), and CISPO
with the fleet (MiniMax-M1's one-sided clip). Each run's
``metrics.jsonl`` must hold, every step, a finite loss made of its objective's terms, a gradient, the objective's
own metrics and ``actor/entropy``, which also reaches TensorBoard.
"""

import math
import shutil
from functools import partial
from pathlib import Path

import pytest
from helpers.runs import TINY_RUN_FLAGS, TINY_TRAIN_FLAGS, run_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GOLDEN = Path(__file__).parent / "golden"

SYNTHETIC = ["--rollout-source", "synthetic", "--synthetic-reward-rate", "0.5", "--micro-batch-size", "3"]
GSPO_TOKEN_MEAN = [
    *("--loss", "gspo", "--advantage-estimator", "reinforce_plus_plus_baseline", "--loss-agg-mode", "token-mean"),
    *("--clip-ratio-low", "3e-4"),
]
# name -> (world size, fleet, flags, the metrics the objective reports every step)
RUNS = {
    "gspo_rpp_dp2": (2, False, GSPO_TOKEN_MEAN, ("gspo/loss", "gspo/clip_frac", "gspo/advantage/mean")),
    "gspo_rpp_dp1": (1, False, GSPO_TOKEN_MEAN, ("gspo/loss", "gspo/clip_frac", "gspo/advantage/mean")),
    "cispo_rloo_entropy_kl": (
        1,
        False,
        [
            *("--loss", "cispo", "--advantage-estimator", "rloo", "--loss-agg-mode", "seq-mean-token-sum"),
            *("--clip-ratio-high", "4.0", "--entropy-coef", "0.01", "--kl-coef", "0.05"),
        ],
        ("cispo/loss", "actor/entropy_loss", "ref/kl_loss"),
    ),
    "drgrpo_truncated": (
        1,
        False,
        [
            *("--loss", "grpo", "--no-norm-adv-by-std", "--loss-agg-mode", "seq-mean-token-mean"),
            *("--mask-truncated", "--overlong-buffer-len", "4", "--overlong-penalty-factor", "0.5"),
        ],
        ("grpo/loss", "grpo/truncated_frac", "grpo/overlong_penalty", "grpo/clip_frac_lower"),
    ),
    "dapo_opo_fleet": (
        1,
        True,
        [
            *("--loss", "grpo", "--advantage-estimator", "opo", "--loss-agg-mode", "token-mean"),
            *("--clip-ratio-low", "0.2", "--clip-ratio-high", "0.28", "--clip-ratio-c", "10.0"),
            *("--filter-groups", "zero-variance", "--overlong-buffer-len", "4", "--micro-batch-size", "3"),
        ],
        ("grpo/loss", "grpo/overlong_penalty", "grpo/clip_frac"),
    ),
    "gspo_tis_fleet": (
        1,
        True,
        [
            *("--loss", "gspo", "--loss-agg-mode", "seq-mean-token-sum-norm", "--micro-batch-size", "3"),
            *("--off-policy-correction", "tis"),  # GSPO's geometric-mean ratio against the engines' log-probs
        ],
        ("gspo/loss", "gspo/clip_frac", "offpolicy/is_ratio_mean"),
    ),
    "cispo_rpp_fleet": (
        1,
        True,
        [
            *("--loss", "cispo", "--advantage-estimator", "reinforce_plus_plus_baseline"),
            *("--loss-agg-mode", "seq-mean-token-mean", "--clip-ratio-low", "1.0", "--clip-ratio-high", "4.0"),
            *("--micro-batch-size", "3"),
        ],
        ("cispo/loss", "cispo/clip_frac"),
    ),
}


VOCAB = 512  # the golden model's vocabulary: the entropy is below log(VOCAB)


def prepare(root: Path) -> Path:
    """The golden trace's model and problems (tests/golden/: the demo's warmed-up tiny model, whose rewards are
    mixed, so dynamic sampling finds groups to train on)."""
    shutil.copytree(GOLDEN / "model", root / "model")
    shutil.copy(GOLDEN / "train.jsonl", root / "train.jsonl")
    return root


def _run(root: Path, name: str) -> list[dict]:
    world, fleet, flags, _ = RUNS[name]
    common = ["--hf-model", str(root / "model"), "--train-data", str(root / "train.jsonl"), "--train-iters", "2"]
    common += ["--seed", "3"]  # mixed rewards in the golden trace's first steps
    shared = TINY_RUN_FLAGS if fleet else [*TINY_TRAIN_FLAGS, *SYNTHETIC]
    return run_train([*common, *shared, *flags], log_dir=root / name, cwd=root, world=world)


LAUNCHES = {name: partial(_run, name=name) for name in RUNS}  # queued for the session (tests/launch_queue.py)


@pytest.mark.parametrize("name", list(RUNS))
def test_objective_trains_and_reports_its_terms_and_the_entropy(launched, name):
    history = launched[name].result()
    steps = [m for m in history if "train/loss" in m]
    assert len(steps) == 2, history
    for m in steps:
        for key in ("train/loss", "train/grad_norm", "actor/entropy", *RUNS[name][3]):
            assert key in m and math.isfinite(m[key]), (name, key, m)
        assert m["train/grad_norm"] > 0 and m["train/optimizer_steps"] == 2
        assert 0 < m["actor/entropy"] < math.log(VOCAB)  # a distribution over the tiny model's 512-token vocabulary
        terms = [k for k in ("actor/entropy_loss", "ref/kl_loss") if k in RUNS[name][3]]
        loss_key = RUNS[name][3][0]
        assert m["train/loss"] == pytest.approx(m[loss_key] + sum(m[k] for k in terms), rel=1e-6, abs=1e-9)
        if "grpo/overlong_penalty" in m:
            assert m["grpo/overlong_penalty"] <= 0
        if "actor/entropy_loss" in m:  # -coef x the entropy's aggregate: negative
            assert m["actor/entropy_loss"] < 0


def test_token_mean_is_global_over_data_parallel_ranks(launched):
    """The same synthetic rollouts at DP=2 and DP=1 (other micro-batch cuts): token-mean's normaliser is the whole
    mini-batch's token count, so loss and gradient agree to rounding (a per-rank mean would not)."""
    dp2, dp1 = ([m for m in launched[n].result() if "train/loss" in m] for n in ("gspo_rpp_dp2", "gspo_rpp_dp1"))
    for a, b in zip(dp2, dp1, strict=True):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        for key in ("train/loss", "train/grad_norm", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key


def test_entropy_reaches_tensorboard(launch_queue, launched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launched["cispo_rloo_entropy_kl"].result()
    events = sorted((launch_queue.root(__name__) / "cispo_rloo_entropy_kl").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert len(acc.Scalars("actor/entropy")) == 2


def test_the_fleet_runs_engines_are_forked_by_the_suites_engine_server(launched):
    """The suite's harness, not an objective: each fleet launch's own local Ray started its engine actors as children
    of an engine server (tests/zygote_ray_hook.py), vLLM imported once for every launch rather than in each engine
    (~6 of an engine's ~8 CPU-s). At least one: a worker the server cannot serve runs the real interpreter by design
    (one of the three fleet launches' engines did, once, in a run beside tests/rollout/test_fleet.py, cause not
    found). Reads the servers' logs: no cost of its own."""
    import zygote

    if why := zygote.off_reason():
        pytest.skip(why)
    fleet = [name for name, run in RUNS.items() if run[1]]
    for name in fleet:
        launched[name].result()
    workers = [
        program
        for profile, program in zygote.forks("engine")
        if profile.get("MKL_CBWR") == "COMPATIBLE" and program.endswith("default_worker.py")  # the launches' pins
    ]
    assert workers, zygote.forks("engine")
