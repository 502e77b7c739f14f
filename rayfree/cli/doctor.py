"""`rayfree doctor`: check what breaks multi-node runs in practice, and say how to fix each.

Each check prints one line (ok / warn / FAIL) and, when not ok, the fix. The
exit code is 1 when any check fails, so `doctor --quick` serves as a
container healthcheck: --quick skips what touches the network (connecting to
the master, binding ports).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from rayfree import settings
from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.loading import load_config
from rayfree.transport.secure.policy import SecretError

from .checks import Check

__all__ = ["run_doctor", "Check", "diagnose"]

GiB = 1 << 30


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / (1 << 20):.0f} MiB"


def check_shm(config: ClusterConfig) -> Check:
    from rayfree.transport import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
    from rayfree.transport.shm.segment import shm_free_bytes
    from rayfree.worker.proc import REPLY_CHUNK_BYTES, REPLY_CHUNKS

    par = config.parallel
    per_replica = (
        DEFAULT_MAX_CHUNK_BYTES * DEFAULT_MAX_CHUNKS if par.node_rank_within_dp == 0 else 0
    ) + par.local_ranks * REPLY_CHUNK_BYTES * REPLY_CHUNKS
    need = per_replica * len(par.node_replicas)
    free = shm_free_bytes()
    if free is None:
        return Check(
            "/dev/shm",
            "FAIL",
            "/dev/shm is missing or unreadable",
            "mount a tmpfs on /dev/shm (docker: --ipc=host or --shm-size=2g)",
        )
    detail = f"{_fmt(free)} free; this node's queues need {_fmt(need)} (broadcast ring + one reply ring per rank)"
    if free < need:
        return Check(
            "/dev/shm",
            "FAIL",
            detail,
            f"give it at least {_fmt(2 * need)}: docker run --shm-size="
            f"{max(1, 2 * need // GiB + 1)}g (compose: shm_size, or ipc: host)",
        )
    if free < 2 * need:
        return Check("/dev/shm", "warn", detail, "little headroom for large messages: enlarge /dev/shm")
    return Check("/dev/shm", "ok", detail)


def check_ip(config: ClusterConfig) -> tuple[Check, str]:
    from rayfree.transport.net import HOST_IP_ENV, default_route_ip, get_ip, interface_of, route_to

    par = config.parallel
    multi = par.nnodes > 1
    ip = get_ip(peer=par.master_addr if multi else None)
    if settings.is_set(HOST_IP_ENV):
        why = f"{HOST_IP_ENV} is set"
    elif multi and route_to(par.master_addr) == ip:
        why = f"it is the source address of the route toward master_addr {par.master_addr}"
    elif ip == default_route_ip():
        why = "it is the address of the default route's interface"
    else:
        why = "nothing better was found"
    iface = interface_of(ip) or "?"
    detail = f"{ip} on {iface} ({why})"
    if multi and (ip.startswith("127.") or ip == "::1"):
        return Check(
            "address",
            "FAIL",
            detail,
            f"other nodes cannot reach loopback: set {HOST_IP_ENV} to this node's cluster address",
        ), ip
    return Check("address", "ok", detail), ip


def check_master(config: ClusterConfig, quick: bool) -> Check:
    from rayfree.transport.net import is_local_address, route_to

    par = config.parallel
    where = f"{par.master_addr}:{par.master_port}"
    try:
        socket.getaddrinfo(par.master_addr, None)
    except OSError as e:
        return Check(
            "master_addr",
            "FAIL",
            f"{par.master_addr!r} does not resolve ({e})",
            "give node 0's IP address (RAYFREE_MASTER_ADDR / --master-addr)",
        )
    if par.node_rank == 0:
        if not is_local_address(par.master_addr):
            return Check(
                "master_addr",
                "FAIL",
                f"{par.master_addr} is not an address of this machine, but this is node 0, which hosts the rendezvous",
                "set master_addr to one of this node's addresses",
            )
        return Check("master_addr", "ok", f"{where} is local (this node hosts the rendezvous)")
    src = route_to(par.master_addr)
    if src is None:
        return Check(
            "master_addr",
            "FAIL",
            f"no route to {par.master_addr}",
            "check the network between the nodes, or the address",
        )
    if quick:
        return Check("master_addr", "ok", f"routes via {src}")
    try:
        with socket.create_connection((par.master_addr, par.master_port), timeout=2):
            return Check("master_addr", "ok", f"{where} answers (routes via {src})")
    except OSError as e:
        return Check(
            "master_addr",
            "warn",
            f"{where} does not answer yet ({e.strerror or e})",
            "start node 0 (followers may start first: they wait), or open that port in the firewall",
        )


def check_ports(config: ClusterConfig) -> Check:
    par = config.parallel
    if par.node_rank != 0:
        return Check("ports", "ok", "only node 0 listens on fixed ports")
    from rayfree.transport.net import is_local_address

    if not is_local_address(par.master_addr):
        return Check("ports", "warn", f"not checked: {par.master_addr} is not an address of this machine")
    busy, ours = [], []
    for port in (par.master_port, config.heartbeat_endpoint_port):
        with socket.socket(socket.AF_INET6 if ":" in par.master_addr else socket.AF_INET) as s:
            try:
                s.bind((par.master_addr, port))
            except OSError:
                owner = listener_of(port)
                (ours if owner is not None and _is_rayfree_node(owner[1]) else busy).append((port, owner))
    if ours and not busy:
        pids = sorted({o[0] for _, o in ours if o})
        return Check(
            "ports",
            "ok",
            f"{par.master_port} (rendezvous) and {config.heartbeat_endpoint_port} "
            f"(heartbeats) are held by this node's running rayfree node (pid {', '.join(map(str, pids))})",
        )
    if busy:
        held = "; ".join(f"{p} by pid {o[0]} ({o[1][:60]})" if o else f"{p}" for p, o in busy)
        return Check(
            "ports",
            "FAIL",
            f"port(s) in use on {par.master_addr}: {held}",
            "stop whatever holds them (another rayfree leader?) or change master_port / heartbeat_port",
        )
    return Check(
        "ports", "ok", f"{par.master_port} (rendezvous) and {config.heartbeat_endpoint_port} (heartbeats) are free"
    )


def listener_of(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on TCP `port` here, from /proc; None if unknown."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        return int(pid), f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
    return None


def _is_rayfree_node(cmdline: str) -> bool:
    """A `rayfree node` (or an engine running rayfree's executor: its workers hold the rendezvous port)."""
    return "rayfree" in cmdline


def hostname_address() -> tuple[str, str | None]:
    """This host's name and the address it resolves to (None: it does not), as gloo finds its own address."""
    host = socket.gethostname()
    try:
        return host, socket.gethostbyname(host)
    except OSError:
        return host, None


def check_ifnames(ip: str) -> Check:
    from rayfree.transport.net import interface_of

    gloo, nccl = os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")
    if not gloo and not nccl:
        host, addr = hostname_address()
        if addr is None or ipaddress.ip_address(addr).is_loopback:
            mine = interface_of(ip)
            seen = f"resolves to {addr}, a loopback address" if addr else "does not resolve"
            return Check(
                "socket ifname",
                "warn",
                f"GLOO_SOCKET_IFNAME unset and the hostname {host!r} {seen}: gloo binds there, and every "
                f"multi-node world fails in gloo's connectFullMesh",
                f"set GLOO_SOCKET_IFNAME={mine or '<the cluster network interface>'}"
                + (f" (the interface of {ip})" if mine else "")
                + " on every node, or map the hostname to the node's address in /etc/hosts",
            )
        return Check(
            "socket ifname",
            "ok",
            f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset: gloo uses the hostname's address ({host} is {addr})",
        )
    try:
        import netifaces

        names = set(netifaces.interfaces())
    except Exception:  # noqa: BLE001
        names = set()
    for var, val in (("GLOO_SOCKET_IFNAME", gloo), ("NCCL_SOCKET_IFNAME", nccl)):
        if val and names and val.split(",")[0].lstrip("^=") not in names:
            return Check(
                "socket ifname",
                "FAIL",
                f"{var}={val} is not an interface here (have {sorted(names)})",
                f"set {var} to the interface of the cluster network",
            )
    if gloo and nccl and gloo != nccl:
        return Check(
            "socket ifname",
            "warn",
            f"GLOO_SOCKET_IFNAME={gloo} but NCCL_SOCKET_IFNAME={nccl}",
            "use the same interface for both, unless you mean to split the traffic",
        )
    mine = interface_of(ip)
    if gloo and mine and gloo != mine:
        return Check(
            "socket ifname",
            "warn",
            f"GLOO_SOCKET_IFNAME={gloo} but rayfree's address {ip} is on {mine}",
            f"set GLOO_SOCKET_IFNAME={mine}, or RAYFREE_HOST_IP to an address on {gloo}",
        )
    return Check(
        "socket ifname",
        "ok",
        ", ".join(f"{k}={v}" for k, v in (("GLOO_SOCKET_IFNAME", gloo), ("NCCL_SOCKET_IFNAME", nccl)) if v),
    )


def check_stale(fix: bool, ask: bool) -> Check:
    from rayfree.transport.shm.segment import stale_entries

    stale = stale_entries()
    if not stale:
        return Check("stale segments", "ok", "no rayfree segment or ipc directory of a dead process")
    size = sum(os.path.getsize(p) for p in stale if os.path.isfile(p))
    detail = f"{len(stale)} left by dead processes ({_fmt(size)}): {', '.join(os.path.basename(p) for p in stale[:4])}"
    if ask and not fix:
        answer = input(f"  remove {len(stale)} stale rayfree segment(s) ({_fmt(size)})? [y/N] ")
        fix = answer.strip().lower() in ("y", "yes")
    if fix:
        import shutil

        for p in stale:
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
        return Check("stale segments", "ok", detail + " - removed")
    return Check("stale segments", "warn", detail, "run `rayfree doctor --fix` to remove them")


def check_security(config: ClusterConfig, secret_error: SecretError | None = None) -> Check:
    from rayfree.transport.secure.policy import INSECURE_ENV, SecretError, insecure, process_secret

    try:
        if secret_error is not None:  # --secret-file / RAYFREE_SECRET_FILE named a file that cannot be used
            raise secret_error
        secret = process_secret()
    except SecretError as e:
        return Check("security", "FAIL", e.problem, e.fix)
    if secret is not None:
        return Check(
            "security",
            "ok",
            f"cluster secret from {secret.source} (fingerprint {secret.fingerprint}): "
            f"the queues are sealed with AES-256-GCM, the heartbeats use CURVE, handles are signed",
        )
    if config.parallel.nnodes == 1:
        return Check("security", "ok", "one node: no TCP socket, no secret needed")
    if insecure():
        return Check(
            "security",
            "warn",
            f"INSECURE ({INSECURE_ENV}=1 / --insecure): anyone who reaches this "
            f"node's ports can read the broadcasts and run code on the workers",
            "run `rayfree keygen FILE` and give every node --secret-file FILE",
        )
    return Check(
        "security",
        "FAIL",
        "no cluster secret: a multi-node run will refuse to start",
        "run `rayfree keygen FILE` once and give every node --secret-file FILE (or --insecure on a trusted network)",
    )


def diagnose(
    config: ClusterConfig,
    quick: bool = False,
    fix: bool = False,
    ask: bool = False,
    secret_error: SecretError | None = None,
) -> list[Check]:
    checks = [check_security(config, secret_error), check_shm(config)]
    ip_check, ip = check_ip(config)
    checks += [ip_check, check_master(config, quick)]
    if not quick:
        checks.append(check_ports(config))
    from .doctor_gpu import check_collectives_address, gpu_checks

    checks += [check_ifnames(ip), check_collectives_address(ip), *gpu_checks(config), check_stale(fix, ask)]
    return checks


def run_doctor(args: argparse.Namespace) -> int:
    from rayfree.launch.launchers import LaunchError
    from rayfree.launch.placement import place

    try:
        placement = place(args, os.environ)
    except LaunchError as e:
        print(f"rayfree doctor: {e}")
        return 2
    args = argparse.Namespace(**{**vars(args), **placement.filled})
    try:
        # Node 0's "master_addr must be local" is reported as a check, not as a crash.
        config = load_config(args, check_local_master=False)
    except ConfigError as e:
        print(f"rayfree doctor: the configuration itself is wrong: {e}")
        return 1
    par = config.parallel
    print(
        f"rayfree doctor: node {par.node_rank} of {par.nnodes}, {par.local_ranks * len(par.node_replicas)} "
        f"rank(s) here, master {par.master_addr}:{par.master_port}"
    )
    launch = placement.launch
    print(f"  placement (launcher {launch.launcher if launch else 'none detected'}):")
    for line in placement.describe():
        print(f"    {line}")
    if par.data_parallel_size > 1:
        print(
            f"  DP={par.data_parallel_size} replicas of {par.world_size} rank(s), in one world of "
            f"{par.world_size_across_dp}:"
        )
        for r in range(par.data_parallel_size):
            nodes = par.nodes_of_replica(r)
            here = (
                " <- this node" + (" (leads it)" if nodes[0] == par.node_rank else "") if par.node_rank in nodes else ""
            )
            print(
                f"    replica {r}: node(s) {nodes}, world ranks {par.global_rank(0, r)}.."
                f"{par.global_rank(par.world_size - 1, r)}{here}"
            )
    secret_error = getattr(args, "secret_error", None)
    checks = diagnose(
        config, quick=args.quick, fix=args.fix, ask=not args.quick and sys.stdin.isatty(), secret_error=secret_error
    )
    for c in checks:
        print(f"  [{c.status:^4}] {c.name:<15} {c.detail}")
        if c.fix and c.status != "ok":
            print(f"  {'':6} {'':<15} fix: {c.fix}")
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"  {len(failed)} problem(s)" if failed else "  nothing blocks a run")
    if secret_error is not None:
        return 2  # a usage error, as `rayfree node` reports it
    return 1 if failed else 0
