"""The documented multi-host deployment, run as documented on a virtual cluster of 4 hosts.

2 training hosts x 1 rank (torchrun, gloo across the bridge) + a Ray rollout cluster of 2 hosts (head + worker,
one vLLM engine each) reached through Ray Client; weights broadcast from trainer rank 0 to the engines on the
other hosts after every step; 3 steps with a checkpoint every step (the ``continuous`` fixture runs it).
"""

from __future__ import annotations

import json

import pytest
from cluster_fixtures import *  # noqa: F403 - the fixtures

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

#: What c10d prints on every rank when it cannot look a peer's address up (no reverse DNS for the hosts).
C10D_WARNING = "hostname of the client socket cannot be retrieved"


def test_two_training_hosts_and_two_rollout_hosts_train_sync_and_checkpoint(continuous):
    run = continuous
    assert run.codes == {"train0": 0, "train1": 0}, run.logs[-12000:]
    assert [r["step"] for r in run.rows] == [1, 2, 3], run.logs[-12000:]
    for r in run.rows:
        assert r["sync/max_logprob_diff"] <= 1e-5, r  # the max over both engines, each on its own host
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0, r
    ckpt = run.workdir / "run-ckpt" / "iter_0000003"
    assert json.loads((ckpt / "megatron_pacs.json").read_text())["step"] == 3
    assert not list((run.workdir / "run-ckpt").glob(".iter_*.tmp-*"))

    # The engines, on two other hosts, were told to reach trainer rank 0 at its address on the bridge.
    assert f"weight sync rendezvous at {run.train0_address} " in run.logs
    assert C10D_WARNING not in run.logs
    assert run.engines_left == {}  # the trainer's exit released its engine actors
    assert run.leftovers == {}  # and every process on the training hosts is gone (the rollout hosts stay up)
