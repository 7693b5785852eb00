"""Addresses and ports a process picks for others to reach it (torch-free: launchers and workers use it)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free right now. It is released before its user binds it: another process may take it in between,
    which then fails that start with "address in use" rather than joining a wrong job."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def reachable_address(peer_host: str, peer_port: int) -> str:
    """This host's address on the interface that routes to the peer (loopback when the peer is local)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]
