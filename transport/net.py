"""Which address to use, which port is free, and where private ipc endpoints live.

Nothing here sends a packet: the route toward a peer is read by connecting a
UDP socket (which only asks the kernel's routing table), and the default
route comes from the interface table.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import shutil
import socket
import tempfile

from rayfree import settings

__all__ = [
    "get_ip",
    "get_open_port",
    "tcp_endpoint",
    "is_ipv6",
    "IpcDir",
    "route_to",
    "default_route_ip",
    "local_addresses",
    "is_local_address",
    "port_holder",
    "interface_of",
    "bind_address",
]

logger = logging.getLogger("rayfree.transport")

HOST_IP_ENV = "RAYFREE_HOST_IP"


def is_ipv6(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.strip("[]").split("%")[0]).version == 6
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int | str) -> str:
    """ZeroMQ endpoint for host:port, bracketing IPv6 literals."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if is_ipv6(host) else f"tcp://{host}:{port}"


def route_to(peer: str) -> str | None:
    """The local address the kernel would use toward `peer` (None: no route, or it does not resolve)."""
    try:
        infos = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)  # UDP connect: routing lookup only, nothing is sent
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def default_route_ip() -> str | None:
    """The address of the default route's interface, if there is one."""
    try:
        import netifaces
    except ImportError:  # pragma: no cover - it is a dependency
        return None
    try:
        default = netifaces.gateways().get("default", {})
    except Exception:  # noqa: BLE001 - odd platforms raise odd things
        return None
    for family in (netifaces.AF_INET, netifaces.AF_INET6):
        gw = default.get(family)
        if not gw:
            continue
        for a in netifaces.ifaddresses(gw[1]).get(family, []):
            addr = a.get("addr", "")
            if addr and not addr.startswith("fe80"):
                return addr.split("%")[0]
    return None


def get_ip(peer: str | None = None) -> str:
    """This host's address for cluster traffic.

    Order: $RAYFREE_HOST_IP; the local address that routes toward `peer`;
    the address of the default route's interface; loopback.
    """
    env = settings.get(HOST_IP_ENV)
    if env:
        return env
    if peer:
        ip = route_to(peer)
        if ip:
            return ip
        logger.warning("no route toward %s; falling back to the default interface", peer)
    ip = default_route_ip()
    if ip:
        return ip
    logger.warning("no default route; using loopback. Set %s to this node's cluster address.", HOST_IP_ENV)
    return "127.0.0.1"


def get_open_port(host: str | None = None) -> int:
    """A TCP port that is free right now on `host` (default: this host's cluster address).

    Picked below the kernel's ephemeral range when there is room: a port from that range, once released
    here, is one the kernel may hand to any outgoing connection on the machine a moment later, before the
    caller binds it (seen in CI: a rendezvous port taken that way). Falls back to the kernel's choice.
    """
    host = (host or get_ip()).strip("[]")
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low > _FIXED_LOW + 1000 else 0):
        port = rng.randrange(_FIXED_LOW, low)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: the lowest port get_open_port picks (below it: well-known and registered services)
_FIXED_LOW = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def runtime_dir() -> str:
    """Where private ipc directories go: $XDG_RUNTIME_DIR if usable, else the temp dir."""
    d = os.environ.get("XDG_RUNTIME_DIR")
    if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
        return d
    return tempfile.gettempdir()


class IpcDir:
    """A private (0700) directory for ipc:// endpoints, removed by `remove()`."""

    def __init__(self) -> None:
        # The creator's pid in the name lets `rayfree doctor` tell stale ones.
        self.path = tempfile.mkdtemp(prefix=f"rayfree-{os.getpid()}-", dir=runtime_dir())
        os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def local_addresses() -> set[str]:
    """Every address of this machine's interfaces (loopback included)."""
    out = {"127.0.0.1", "::1"}
    try:
        import netifaces

        for iface in netifaces.interfaces():
            for fam in (netifaces.AF_INET, netifaces.AF_INET6):
                for a in netifaces.ifaddresses(iface).get(fam, []):
                    out.add(a["addr"].split("%")[0])
    except Exception:  # noqa: BLE001 - best effort
        pass
    return out


def port_holder(port: int, host: str = "0.0.0.0") -> str | None:
    """Why `port` cannot be listened on here (another process listens on it), or None when it can: a bind on
    every interface with SO_REUSEADDR, as a server binds it (a connection of an earlier run still in TIME_WAIT
    does not count)."""
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def is_local_address(host: str) -> bool:
    """Does `host` (an address or a name) resolve to an address of this machine?"""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        if ip.is_loopback:
            return True
        candidates = {str(ip)}
    except ValueError:
        try:
            candidates = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
        except OSError:
            return False
    mine = local_addresses()
    return any(c.split("%")[0] in mine or ipaddress.ip_address(c.split("%")[0]).is_loopback for c in candidates)


def interface_of(ip: str) -> str | None:
    """The name of the interface that has address `ip` (None if none does)."""
    try:
        import netifaces

        for iface in netifaces.interfaces():
            for fam in (netifaces.AF_INET, netifaces.AF_INET6):
                if any(a.get("addr", "").split("%")[0] == ip for a in netifaces.ifaddresses(iface).get(fam, [])):
                    return iface
    except Exception:  # noqa: BLE001 - best effort
        pass
    return None


def bind_address(host: str) -> str:
    """An address to bind for `host` (a name or an address of this machine); ValueError if it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"{host!r} does not resolve ({e}): give node 0's IP address") from None
