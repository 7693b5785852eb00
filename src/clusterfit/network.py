"""Addresses and ports a process picks for others to reach it (torch-free: launchers and workers use it).
`python -m clusterfit.network` prints a free port, for a batch script on a node (Slurm's)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below the kernel's ephemeral ports and below Kubernetes' NodePorts (30000-32767); above Ray's worker ports
# (10002-19999). torch's own default MASTER_PORT, 29500, is in it too.
_CHOSEN_PORTS = range(20000, 30000)
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64


def free_port() -> int:
    """A port free right now, for a server that another process starts later: it is released before that
    process binds it. It is picked outside the kernel's ephemeral ports, where every connect() and every bind
    to port 0 on the machine (gloo's pairs, Ray's workers, other jobs) takes its own: there, one of them could
    take it in between, and the server would fail with "address already in use". Only when those ports leave
    no room is it the kernel's pick."""
    ours = range(_CHOSEN_PORTS.start, min(_CHOSEN_PORTS.stop, _ephemeral_ports().start))
    for port in random.SystemRandom().sample(ours, min(_TRIES, len(ours))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:  # in use, or still held by a closing connection
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_ports() -> range:
    try:
        low, high = (int(word) for word in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):  # not Linux: IANA's dynamic ports, as macOS and Windows use
        low, high = 49152, 65535
    return range(low, high + 1)


def reachable_address(peer_host: str, peer_port: int) -> str:
    """This host's address on the interface that routes to the peer (loopback when the peer is local)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


if __name__ == "__main__":
    print(free_port())
