"""Address choice, ports and private ipc directories."""

from __future__ import annotations

import os
import socket
import stat

import netifaces

from rayfree.transport.net import IpcDir, get_ip, get_open_port, tcp_endpoint


def _local_addresses() -> set[str]:
    out = set()
    for iface in netifaces.interfaces():
        for fam in (netifaces.AF_INET, netifaces.AF_INET6):
            for a in netifaces.ifaddresses(iface).get(fam, []):
                out.add(a["addr"].split("%")[0])
    return out


def test_env_override_wins(monkeypatch) -> None:
    monkeypatch.setenv("RAYFREE_HOST_IP", "10.9.8.7")
    assert get_ip() == "10.9.8.7"
    assert get_ip(peer="127.0.0.1") == "10.9.8.7"


def test_route_toward_a_peer_picks_the_matching_local_address(monkeypatch) -> None:
    monkeypatch.delenv("RAYFREE_HOST_IP", raising=False)
    assert get_ip(peer="127.0.0.1") == "127.0.0.1"
    assert get_ip(peer="::1") == "::1"


def test_default_is_an_address_of_this_host(monkeypatch) -> None:
    monkeypatch.delenv("RAYFREE_HOST_IP", raising=False)
    assert get_ip() in _local_addresses() | {"127.0.0.1"}


def test_open_port_is_bindable_on_the_given_host() -> None:
    port = get_open_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_tcp_endpoint_brackets_ipv6() -> None:
    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    assert tcp_endpoint("10.0.0.1", "*") == "tcp://10.0.0.1:*"


def test_ipc_dir_is_private_and_removed() -> None:
    d = IpcDir()
    try:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
        assert d.endpoint("x").startswith("ipc://" + d.path)
    finally:
        d.remove()
    assert not os.path.exists(d.path)
