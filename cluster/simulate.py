"""Simulated nodes on one machine, for tests and the demo.

As root, node k is a network namespace with its own address on a private
bridge (10.77.0.k+1/24, on a bridge that lives in a namespace of its own, so
nothing touches the host's network) and, by default, its own /dev/shm (a
private tmpfs in its own mount namespace): a different node for every purpose
that matters to rayfree. Without root it falls back to loopback, where all
nodes share one address and one /dev/shm, and sets RAYFREE_FORCE_REMOTE so
ranks still treat each other as remote; it says so in the log.

    with SimulatedCluster(2) as sim:
        p = sim.nodes[1].popen([sys.executable, "-m", "my.rank", ...], env=sim.env(1))

Everything it made (processes, namespaces, links, mounts) is removed on exit,
also when the body raises.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence

__all__ = ["SimulatedCluster", "SimulatedNode", "can_use_netns", "netns_missing"]

logger = logging.getLogger("rayfree.cluster")

SUBNET = "10.77.0"
_SHM_BASE = "/run/rayfree-sim"
_seq = 0
_seq_lock = threading.Lock()


def netns_missing() -> str:
    """What simulated nodes with a network namespace each lack here ("" when nothing): root, `ip` (iproute2)
    or `unshare` (util-linux)."""
    lack = [] if os.geteuid() == 0 else ["root"]
    tools = (("ip", "iproute2"), ("unshare", "util-linux"))
    lack += [f"`{tool}` ({pkg})" for tool, pkg in tools if not shutil.which(tool)]
    return " and ".join(lack)


def can_use_netns() -> bool:
    """Root, and `ip` and `unshare` present."""
    return not netns_missing()


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


class SimulatedNode:
    """One node: where its processes run and how to reach it."""

    def __init__(
        self,
        cluster: SimulatedCluster,
        index: int,
        ip: str,
        netns: str | None,
        shm_dir: str | None = None,
        hostname: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.index = index
        self.ip = ip
        self.netns = netns
        self.shm_dir = shm_dir
        #: the node's own host name (its own UTS namespace), when the cluster names its nodes
        self.hostname = hostname
        self.procs: list[subprocess.Popen] = []

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this node (its namespace and its /dev/shm)."""
        argv = list(argv)
        if self.netns is None:
            return argv
        inner = argv
        steps = []
        if self.shm_dir:  # every process of the node sees the node's tmpfs as its /dev/shm
            steps.append(f"mount --bind {self.shm_dir} /dev/shm")
        if self.cluster.hosts_file:  # and the cluster's names in its /etc/hosts
            steps.append(f"mount --bind {self.cluster.hosts_file} /etc/hosts")
        if self.hostname:
            steps.append(f"hostname {self.hostname}")
        if self.cluster.files:  # a /run of the node's own, holding the files it is given (a pod's secrets)
            steps.append("mount -t tmpfs -o mode=755 rayfree-sim-run /run")
            for inside, src in self.cluster.files.items():
                steps.append(f"mkdir -p {os.path.dirname(inside)} && cp -p {src} {inside}")
        if steps:
            inner = [
                "unshare",
                "--mount",
                *(["--uts"] if self.hostname else []),
                "--propagation",
                "private",
                "sh",
                "-c",
                " && ".join(steps) + ' && exec "$@"',
                "sh",
                *argv,
            ]
        return ["ip", "netns", "exec", self.netns, *inner]

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start a process on this node, in a session of its own (so `kill` gets its children too)."""
        full_env = dict(os.environ)
        full_env.update(self.cluster.env(self.index))
        if env:
            full_env.update(env)
        p = subprocess.Popen(self.command(argv), env=full_env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process this node started, with all their descendants (also those that made a session
        of their own, as torchrun's workers do): a node that goes down takes every process on it along."""
        from rayfree.procs import descendants

        for p in self.procs:
            if p.poll() is None:
                below = descendants(p.pid)
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
                for pid in below:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass

    def set_link(self, up: bool) -> None:
        """Cut (or restore) this node's cable to the bridge."""
        if self.netns is None:
            raise RuntimeError("link control needs network namespaces (run as root)")
        _ip("-n", self.cluster.switch_ns, "link", "set", f"p{self.index}", "up" if up else "down")


class SimulatedCluster:
    """`nnodes` simulated nodes; a context manager (see the module docstring)."""

    def __init__(
        self,
        nnodes: int,
        *,
        private_shm: bool = True,
        shm_size: str = "1g",
        use_netns: bool | None = None,
        hostnames: Sequence[str] | None = None,
        aliases: dict[str, int] | None = None,
        files: dict[str, str] | None = None,
    ) -> None:
        """`hostnames`: a name per node (its own hostname, and in every node's /etc/hosts); `aliases`: more
        names for node k in /etc/hosts (a Kubernetes service name, say); `files`: {path under /run: host
        file} copied into each node's own /run (a tmpfs), as a pod's mounted secret."""
        if nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {nnodes}")
        self.nnodes = nnodes
        self.private_shm = private_shm
        self.shm_size = shm_size
        self.use_netns = can_use_netns() if use_netns is None else use_netns
        global _seq
        with _seq_lock:
            _seq += 1
            self.tag = f"rf{os.getpid() % 100000}x{_seq}"
        self.switch_ns = f"{self.tag}-sw"
        self.nodes: list[SimulatedNode] = []
        self.hostnames = list(hostnames) if hostnames else []
        if self.hostnames and len(self.hostnames) != nnodes:
            raise ValueError(f"hostnames: {len(self.hostnames)} names for {nnodes} nodes")
        self.aliases = dict(aliases or {})
        self.hosts_file: str | None = None
        self.files = dict(files or {})
        if any(not p.startswith("/run/") for p in self.files):
            raise ValueError(f"files: paths inside a node must be under /run/, got {sorted(self.files)}")
        self._made: list[str] = []
        #: the blackhole routes a partition added: (namespace, destination)
        self._routes: list[tuple[str, str]] = []
        self._mounts: list[str] = []
        self._files: list[str] = []
        self._finalizer: weakref.finalize | None = None

    @property
    def mode(self) -> str:
        return "netns" if self.use_netns else "loopback"

    def env(self, node: int) -> dict[str, str]:
        """Environment a process on node `node` needs (interface, address, remote switch)."""
        n = self.nodes[node]
        if self.use_netns:
            return {"GLOO_SOCKET_IFNAME": "eth0", "RAYFREE_HOST_IP": n.ip}
        return {"GLOO_SOCKET_IFNAME": "lo", "RAYFREE_HOST_IP": n.ip, "RAYFREE_FORCE_REMOTE": "1"}

    def __enter__(self) -> SimulatedCluster:
        if not self.use_netns:
            logger.warning(
                "simulated nodes without %s: all nodes share loopback and /dev/shm, and ranks are forced to "
                "treat each other as remote (RAYFREE_FORCE_REMOTE=1)",
                netns_missing() or "network namespaces (use_netns=False)",
            )
            self.nodes = [SimulatedNode(self, k, "127.0.0.1", None) for k in range(self.nnodes)]
            return self
        self._finalizer = weakref.finalize(self, _remove_all, self._made, self._mounts, self._files)
        try:
            self._add_ns(self.switch_ns)
            _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch_ns, "link", "set", "br0", "up")
            for k in range(self.nnodes):
                ns = f"{self.tag}-n{k}"
                self._add_ns(ns)
                ip = f"{SUBNET}.{k + 1}"
                _ip(
                    "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns", self.switch_ns
                )
                _ip("-n", self.switch_ns, "link", "set", f"p{k}", "master", "br0")
                _ip("-n", self.switch_ns, "link", "set", f"p{k}", "up")
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                name = self.hostnames[k] if self.hostnames else None
                self.nodes.append(SimulatedNode(self, k, ip, ns, self._node_shm(k), name))
            if self.hostnames or self.aliases:
                self.hosts_file = self._write_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def _node_shm(self, k: int) -> str | None:
        """A tmpfs for node k's /dev/shm (None: the node shares the host's)."""
        if not self.private_shm:
            return None
        d = os.path.join(_SHM_BASE, f"{self.tag}-n{k}")
        os.makedirs(d, mode=0o755, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.shm_size},mode=1777", "rayfree-sim-shm", d],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode:
            os.rmdir(d)
            raise RuntimeError(f"mounting a tmpfs for node {k}'s /dev/shm at {d} failed: {r.stderr.strip()}")
        self._mounts.append(d)
        return d

    def _write_hosts(self) -> str:
        """The nodes' /etc/hosts: localhost, each node's name, the aliases."""
        os.makedirs(_SHM_BASE, mode=0o755, exist_ok=True)
        path = os.path.join(_SHM_BASE, f"{self.tag}-hosts")
        lines = ["127.0.0.1 localhost"]
        for k, n in enumerate(self.nodes):
            names = ([self.hostnames[k]] if self.hostnames else []) + [a for a, i in self.aliases.items() if i == k]
            if names:
                lines.append(f"{n.ip} {' '.join(names)}")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        self._files.append(path)
        return path

    def partition(self, *sides: Sequence[int]) -> None:
        """Split the network: each node of a side reaches the nodes of its own side only (a node on no side
        reaches every node). Packets across are dropped where they start (a blackhole route to each node of the
        other sides), so a connection across goes silent, as over a failed switch, and a new one is refused
        at once. `heal` undoes it."""
        if not self.use_netns:
            raise RuntimeError("a partition needs network namespaces (run as root)")
        for i, side in enumerate(sides):
            others = [k for j, o in enumerate(sides) if j != i for k in o]
            for k in side:
                for o in others:
                    route = (self.nodes[k].netns or "", f"{self.nodes[o].ip}/32")
                    _ip("-n", route[0], "route", "add", "blackhole", route[1])
                    self._routes.append(route)

    def heal(self) -> None:
        """Undo `partition`: every node reaches every other again."""
        while self._routes:
            ns, dest = self._routes.pop()
            _ip("-n", ns, "route", "del", "blackhole", dest)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def kill_all(self) -> None:
        for n in self.nodes:
            n.kill(signal.SIGKILL)
        for n in self.nodes:
            for p in n.procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    logger.error("process %d on node %d did not die after SIGKILL", p.pid, n.index)

    def close(self) -> None:
        """Kill what the nodes started, then remove every namespace (and with them links and mounts)."""
        self.kill_all()
        if self._finalizer is not None:
            self._finalizer()
        else:
            _remove_all(self._made, self._mounts, self._files)

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_all(names: list[str], mounts: list[str], files: list[str]) -> None:
    _remove_namespaces(names)
    for path in files:
        try:
            os.remove(path)
        except OSError:
            pass
    files.clear()
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", d], capture_output=True, timeout=30)
        try:
            os.rmdir(d)
        except OSError as e:
            logger.error("could not remove %s: %s", d, e)
    mounts.clear()


def _remove_namespaces(names: list[str]) -> None:
    for name in reversed(names):
        for _ in range(50):
            r = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)
            if r.returncode == 0 or "No such file" in r.stderr:
                break
            time.sleep(0.1)  # a process still inside: retry briefly
        else:
            logger.error("could not remove network namespace %s: %s", name, r.stderr.strip())
    names.clear()
