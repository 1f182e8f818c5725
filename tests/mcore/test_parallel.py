"""``lost_rank`` (megatron_pacs/mcore/parallel.py): the rank behind a failed collective, named from the peer address
in gloo's or c10d's message (the multi-host run that loses a host is tests/cluster/test_faults.py)."""

from types import SimpleNamespace

from megatron_pacs.mcore.parallel import lost_rank


def test_the_peer_address_in_the_error_names_the_rank():
    groups = SimpleNamespace(rank_addresses=("10.1.2.3", "10.1.2.4", "10.1.2.40"))
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [10.1.2.4]:51234: Connection reset by peer")
    assert lost_rank(groups, gloo) == 1  # pyright: ignore[reportArgumentType] - only rank_addresses is read
    assert lost_rank(groups, RuntimeError("Connection closed by peer [10.1.2.40]:6000")) == 2  # pyright: ignore
    assert lost_rank(groups, RuntimeError("a timeout with no address")) is None  # pyright: ignore
