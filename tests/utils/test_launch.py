"""``source_address`` (megatron_pacs/utils/launch.py): the address peers reach this host at, from the kernel's
route towards them (the weight-sync rendezvous of a fleet on other hosts; tests/cluster/ checks it across hosts)."""

import socket

from megatron_pacs.utils.launch import source_address


def _own_address() -> str | None:
    """A non-loopback address of this host, if it has a route anywhere."""
    try:
        return source_address(["192.0.2.1"])  # TEST-NET-1: routed by a default route, never contacted
    except OSError:
        return None


def test_loopback_towards_this_host_and_a_routed_address_preferred():
    assert source_address(["127.0.0.1"]) == "127.0.0.1"
    own = _own_address()
    if own is not None:
        assert not own.startswith("127.")
        # peers on this host and elsewhere: the routed address serves both
        assert source_address(["127.0.0.1", "192.0.2.1"]) == own
        socket.inet_aton(own)
