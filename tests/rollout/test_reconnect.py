"""``--rollout-cluster-reconnect-seconds`` without a cluster: what counts as the head's loss, the client endpoint,
a window that ends while the head's port stays closed, and the flag's refusals (the reconnect itself runs on the
virtual cluster: tests/cluster/test_lost_rollout_hosts.py)."""

import socket
import time

import pytest

# the fleet imports Ray at its top; a machine without the rollout stack (the GPU check's image) skips this file
pytest.importorskip("ray", reason="the rollout fleet needs Ray")

from megatron_pacs.config import RolloutConfig, parse_config
from megatron_pacs.config.rollout import check_reconnect_window
from megatron_pacs.rollout.fleet.reconnect import client_endpoint, connect_again, connection_lost
from megatron_pacs.rollout.lost import RolloutClusterLost, lost_line


def test_the_heads_loss_is_recognised_through_the_exception_chain():
    try:
        try:
            raise ConnectionError("Failed during this or a previous request.")
        except ConnectionError as exc:
            raise RuntimeError("fleet: an engine was lost during the weight update") from exc
    except RuntimeError as wrapped:
        assert connection_lost(wrapped)
    assert connection_lost(Exception("Ray Client is not connected. Please connect by calling `ray.init`."))
    assert not connection_lost(RuntimeError("fleet: engine 1 died"))


def test_client_endpoint_and_a_window_that_ends_with_the_port_closed():
    assert client_endpoint("ray://rollout-head:10001") == ("rollout-head", 10001)
    assert client_endpoint("ray://10.0.0.5") == ("10.0.0.5", 10001)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert not connect_again(f"ray://127.0.0.1:{port}", time.monotonic() + 1.0, poll_s=0.2)
    assert time.monotonic() - started < 5
    line = lost_line("ray://h:10001", 60, 61.4)
    assert "ray://h:10001" in line and "--rollout-cluster-reconnect-seconds" in line and "\n" not in line
    assert isinstance(RolloutClusterLost(line), RuntimeError)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rollout_cluster_reconnect_seconds": -1}, "must be >= 0"),
        ({"rollout_cluster_reconnect_seconds": 60}, "--ray-address ray://"),
        ({"rollout_cluster_reconnect_seconds": 60, "ray_address": "head:6379"}, "--ray-address ray://"),
        (
            {"rollout_cluster_reconnect_seconds": 60, "ray_address": "ray://h:10001", "off_policy_steps": 1},
            "--off-policy-steps 0",
        ),
    ],
)
def test_the_flag_is_refused_where_it_cannot_work(kwargs, needle):
    with pytest.raises(ValueError, match="--rollout-cluster-reconnect-seconds") as err:
        RolloutConfig(**kwargs)
    assert needle in str(err.value)


def test_the_window_must_fit_the_collective_timeout_naming_both_flags(monkeypatch):
    monkeypatch.delenv("RAY_CLIENT_RECONNECT_GRACE_PERIOD", raising=False)
    ok = RolloutConfig(ray_address="ray://h:10001", rollout_cluster_reconnect_seconds=270)
    check_reconnect_window(ok, 10)  # 270 + 30 s of Ray Client's grace = half of 10 minutes
    too_long = RolloutConfig(ray_address="ray://h:10001", rollout_cluster_reconnect_seconds=271)
    with pytest.raises(ValueError, match="--rollout-cluster-reconnect-seconds") as err:
        check_reconnect_window(too_long, 10)
    assert "--distributed-timeout-minutes" in str(err.value) and "at most 270" in str(err.value)
    argv = ["--hf-model", "m", "--train-data", "d", "--ray-address", "ray://h:10001"]
    cfg = parse_config([*argv, "--rollout-cluster-reconnect-seconds", "600"])
    with pytest.raises(ValueError, match="--distributed-timeout-minutes"):
        cfg.validate(1, need_files=False)
    parse_config([*argv, "--rollout-cluster-reconnect-seconds", "600", "--distributed-timeout-minutes", "30"]).validate(
        1, need_files=False
    )
