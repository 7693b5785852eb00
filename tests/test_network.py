"""The port a launcher picks for a server that another process starts later (node 0's rendezvous store)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from clusterfit import network

pytestmark = pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux only")


def _ephemeral() -> range:
    low, high = (int(word) for word in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def test_a_free_port_is_outside_the_ports_every_connection_and_port_0_bind_takes() -> None:
    if _ephemeral().start <= 20000:
        pytest.skip("this machine's ephemeral ports leave no room below them")
    ports = {network.free_port() for _ in range(20)}
    assert all(20000 <= port < 30000 and port not in _ephemeral() for port in ports), ports
    assert len(ports) > 1, "picked at random: two launchers on one machine rarely pick the same"
    assert all(_bindable(port) for port in ports)


def test_a_taken_port_is_skipped_and_with_no_room_of_its_own_the_kernel_picks(monkeypatch, tmp_path) -> None:
    kernel_ports = _ephemeral()
    ours = [port for port in range(20000, 30000) if port not in kernel_ports]
    free = next((port for port in ours if _bindable(port) and _bindable(port + 1)), None)
    if free is None:
        pytest.skip("no two free ports below this machine's ephemeral ports")
    monkeypatch.setattr(network, "_EPHEMERAL_RANGE", tmp_path / "range")
    (tmp_path / "range").write_text(f"{kernel_ports.start}\t{kernel_ports.stop - 1}\n")
    with socket.socket() as held:
        held.bind(("", free))
        held.listen()
        monkeypatch.setattr(network, "_CHOSEN_PORTS", range(free, free + 2))
        assert network.free_port() == free + 1
        monkeypatch.setattr(network, "_CHOSEN_PORTS", range(free, free + 1))
        assert network.free_port() in kernel_ports, "every port of its own taken: the kernel's pick"
    (tmp_path / "range").write_text("1024\t65535\n")  # the kernel's ports cover ours: none of our own
    assert network.free_port() in kernel_ports
