"""Joining the world: a rendezvous that names who is missing, notices nodes that disagree, and keeps its bound.

torch.distributed's own rendezvous fails with a bare timeout. Here every rank
first registers in the TCPStore (hosted by rank 0) with a one-line description
of the cluster it thinks it is in (world size and parallel shape), so a rank
that never comes is named, and nodes started with different sizes (`--tp 2`
on one, `--tp 4` on the other) are told so, with what each one has, instead of
"rank 1 never joined". Each entry also carries the node's address and its
cluster secret's fingerprint, so two nodes whose secret files differ are told
that, by address, on both sides. The whole join, store connection included,
ends within `timeout_s`: TCPStore's own connect retries past the timeout it
is given, so a rank first waits, in its own loop, until the store's port
accepts a connection. Rank 0 hosts the store, so when it sees a disagreement it
keeps the store open until every rank that came has said it read the arrivals
(or `TELL_S`): a rank descheduled between two reads would otherwise only learn
that the rendezvous is gone.

The store is torch.distributed's TCPStore: no secret guards it. Anyone who reaches node 0's master port can
read and write its keys while the cluster forms; an entry rayfree did not write (one that does not parse, a
rank's own entry gone) fails the join at once with a line naming the store, and a stranger who only deletes
or holds back keys makes it fail within `timeout_s`: never a hang (operations.md, "Security").
"""

from __future__ import annotations

import datetime
import logging
import re
import socket
import time

from .config import ParallelConfig
from .group import GroupError
from .peers import RENDEZVOUS_GONE

__all__ = ["JoinError", "ForeignEntry", "join", "shape_of", "coupling_of", "widens"]

_SCAN_S = 0.5
#: how often a rank that came before rank 0 tries the store's port (a refused connect costs microseconds)
_PORT_POLL_S = 0.02
#: set by the last rank to come (or by a second claim of a rank): what the others wait for
_ALL = "rayfree/all"
#: counted by each rank (not rank 0) that gives up on the join: rank 0 keeps the store until all have
_TOLD = "rayfree/told"
#: how long rank 0 keeps the store open after a disagreement, at most, for ranks still on their way or not yet
#: done reading it (they say so: it leaves as soon as they have; CI starved a rank for seconds)
TELL_S = 15.0

log = logging.getLogger("rayfree.cluster.join")


class JoinError(GroupError):
    """Ranks did not all join the world in time, or they disagree on its shape; the message says which."""

    #: its message is the whole story (which ranks, where, what to check): reported with no worker traceback
    says_all = True


class ForeignEntry(JoinError):
    """The store holds what no rayfree rank wrote, or lost what one did: something else reached it."""

    def __init__(self, rank: int, where: str, what: str) -> None:
        super().__init__(
            f"rank {rank}: the rendezvous at {where} {what}: something other than this cluster's ranks reached "
            f"node 0's master port (it has no secret: keep it on the nodes' private network)"
        )


def coupling_of(par: ParallelConfig) -> str:
    """How the DP replicas are tied, resolved ("" with one replica)."""
    if par.data_parallel_size == 1:
        return ""
    return "one-world" if par.one_world else "coupled" if par.coupled else "independent"


def shape_of(par: ParallelConfig) -> str:
    """What a rank believes the cluster is, in the words of the flags that set it."""
    replicas = f" replicas={coupling_of(par)}" if par.data_parallel_size > 1 else ""
    return (
        f"tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size} pcp={par.prefill_context_parallel_size} "
        f"dp={par.data_parallel_size} nnodes={par.nnodes}{replicas}"
    )


def widens(shape: str, ours: str) -> bool:
    """Is `shape` (shape_of's words) the cluster `ours` with more DP replicas, laid out the same way: the same
    sizes within a replica and coupling, as many nodes to a replica (or replicas to a node)? A scale-out's new
    nodes are started so: the cluster's command with --dp and --nnodes raised to the new width."""
    a, b = (dict(w.split("=", 1) for w in s.split() if "=" in w) for s in (shape, ours))
    try:
        (dp_a, n_a), (dp_b, n_b) = ((int(w.pop("dp")), int(w.pop("nnodes"))) for w in (a, b))
    except (KeyError, ValueError):
        return False
    return dp_a > dp_b > 1 and a == b and (n_a // dp_a, dp_a // n_a) == (n_b // dp_b, dp_b // n_b)


def _wait_for_port(host: str, port: int, deadline: float) -> bool:
    """Until `deadline`: does host:port accept a TCP connection? (Our bound, where TCPStore's is not kept.)"""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)):
                return True
        except OSError:
            time.sleep(min(_PORT_POLL_S, max(0.0, deadline - time.monotonic())))


def join(
    host: str,
    port: int,
    world_size: int,
    rank: int,
    timeout_s: float,
    shape: str = "",
    node: int = -1,
    prefix: str = "",
    serve_store: bool = False,
):
    """The TCPStore of the world at host:port, once every rank has registered; JoinError otherwise. With
    `prefix`, the ranks meet under it at a store another process hosts (a DP replica that rejoins), or that this
    rank 0 hosts (`serve_store`: node 0 started again, whose replica rejoins)."""
    import torch.distributed as dist

    from rayfree.transport import get_ip

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    hosts = rank == 0 and (not prefix or serve_store)
    if not hosts and not _wait_for_port(host, port, deadline):
        raise JoinError(
            f"rank {rank} could not reach the rendezvous at {host}:{port} within {timeout_s:.0f}s "
            f"(join_timeout_s; gave up after {time.monotonic() - t0:.1f}s): node 0 never started it, or "
            f"master_addr/master_port is wrong or unreachable from here"
        )
    try:
        left = max(1.0, deadline - time.monotonic())
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=hosts,
            timeout=datetime.timedelta(seconds=left),
            wait_for_workers=False,
        )
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError/...
        if hosts:
            _second_rank_zero(host, port, world_size, node, shape)
            raise JoinError(
                f"rank 0 could not host the rendezvous at {host}:{port}: {e}. Is the port free and "
                f"the address one of this node's?"
            ) from e
        raise JoinError(
            f"rank {rank} could not reach the rendezvous at {host}:{port} within {timeout_s:.0f}s "
            f"(gave up after {time.monotonic() - t0:.1f}s): rank 0 never started it, or master_addr/master_port "
            f"is wrong or unreachable"
        ) from e
    if prefix:
        from torch.distributed.distributed_c10d import PrefixStore

        store = PrefixStore(prefix, store)
    ip = host if hosts else get_ip(peer=host)
    me = _entry(rank, world_size, node, ip, shape)
    keys = [f"rayfree/join/{r}" for r in range(world_size)]
    came = {rank}  # (the ranks whose arrival this rank has read: who is missing, without asking the store)
    missing = [r for r in range(world_size) if r != rank]
    where = f"{host}:{port}"
    arrived = False
    try:
        _arrive(store, rank, me, world_size, deadline)
        arrived = True
        seen = 0
        next_scan = time.monotonic() + _SCAN_S
        while not store.check([_ALL]):  # (a duplicate claim sets it too: every rank hears of it at once)
            now = time.monotonic()
            if now >= next_scan or now >= deadline:  # does anyone disagree? (only the arrivals not read yet)
                if not store.check([keys[rank]]):
                    raise ForeignEntry(rank, where, f"lost rank {rank}'s own entry (someone deleted it)")
                seen = _check_agreement(store, seen, me, rank, deadline, where, came=came)
                missing = sorted(set(range(world_size)) - came)
                next_scan = now + _SCAN_S
            if now >= deadline:
                missing = [r for r in range(world_size) if not store.check([keys[r]])]
                raise JoinError(
                    f"rank {rank}: rank(s) {missing} of {world_size} never joined the world at "
                    f"{where} within {timeout_s:.0f}s (join_timeout_s; gave up after "
                    f"{time.monotonic() - t0:.1f}s); check that their node started and can reach {host}"
                )
            time.sleep(0.02)
        _check_agreement(store, seen, me, rank, deadline, where, final=True)
        if not store.check(keys):
            gone = [r for r in range(world_size) if not store.check([keys[r]])]
            raise ForeignEntry(rank, where, f"says every rank came, but rank(s) {gone} have no entry")
    except JoinError:
        if not hosts:
            _heard(store, deadline, arrived)
        raise
    except Exception as e:  # noqa: BLE001 - the store went away: rank 0 gave up or died
        raise JoinError(
            f"rank {rank}: the {RENDEZVOUS_GONE} at {host}:{port} (rank 0 hosted it) while it waited "
            f"for rank(s) {missing} of {world_size} to join"
        ) from e
    return store


def _entry(rank: int, world_size: int, node: int, ip: str, shape: str) -> str:
    """What a rank registers: rank|world|node|address|secret fingerprint|shape (one line, every field read)."""
    from rayfree.transport.secure.policy import fingerprint

    return f"{rank}|{world_size}|{node}|{ip}|{fingerprint()}|{shape}"


def _arrive(store, rank: int, me: str, world_size: int, deadline: float) -> None:
    """Claim `rank`, write this rank's entry and its arrival; the last to come sets the key the others wait on."""
    _claim(store, rank, me, deadline)
    store.set(f"rayfree/join/{rank}", me)
    n = store.add("rayfree/arrivals", 1)
    store.set(f"rayfree/arrival/{n}", me)
    if n >= world_size:  # the last to come says so: the others look at that one key, not at every entry
        store.set(_ALL, b"1")


def _heard(store, deadline: float = float("inf"), arrived: bool = True) -> None:
    """This rank has read what made it give up: rank 0 need not keep the store open for it any longer. It then
    waits (TELL_S at most) until every rank that came has read it too: a rank that left first would end its
    node's other ranks, rank 0 among them on node 0 (its executor stops them at once; node 0 also stops when
    this rank's node says it failed), and the store with them, before a rank elsewhere read why ("the
    rendezvous closed under this rank"). Every rank but rank 0 (the host) says it read; one whose claim was
    refused (`arrived` False: a second node with its rank) is not among the arrivals, but says so too."""
    try:
        store.add(_TOLD, 1)
        until = min(time.monotonic() + TELL_S, deadline)
        extra = 0 if arrived else 1
        while int(store.add(_TOLD, 0)) < int(store.add("rayfree/arrivals", 0)) - 1 + extra and time.monotonic() < until:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone already: nobody waits for this
        pass


def _second_rank_zero(host: str, port: int, world_size: int, node: int, shape: str) -> None:
    """Rank 0 could not host the store: if another rank 0 hosts it already, claim rank 0 there, so both are
    told (JoinError) that two nodes are node 0; else return (the port is taken by something else)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=3), wait_for_workers=False
        )
    except Exception:  # noqa: BLE001 - no store there: not a second rank 0
        return
    _claim(store, 0, _entry(0, world_size, node, host, shape), time.monotonic() + 3)


def _claim(store, rank: int, me: str, deadline: float) -> None:
    """Take `rank`; if another node took it first, both are told (the later one here, the first at its next
    scan, through rayfree/duplicate), naming both nodes: not "rank N never joined" later."""
    if int(store.add(f"rayfree/claim/{rank}", 1)) == 1:
        store.set(f"rayfree/claim-by/{rank}", me)
        return
    store.wait([f"rayfree/claim-by/{rank}"], datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    first = store.get(f"rayfree/claim-by/{rank}").decode()
    text = (
        f"two nodes claim rank {rank}: {_where(first)} and {_where(me)}; give each node its own node rank "
        f"(--node-rank / RAYFREE_NODE_RANK, or the launcher's: under Slurm SLURM_NODEID inside the step, not "
        f"expanded in the batch script)"
    )
    store.set("rayfree/duplicate", text)
    store.set(_ALL, b"1")  # (the ranks waiting for the last one read it now)
    raise JoinError(text)


def _where(entry: str) -> str:
    f = _fields(entry)
    return f"node {f[2]} ({f[3]})" if f[2] != "-1" else f"the process at {f[3]}"


def _check_agreement(
    store,
    seen: int,
    me: str,
    rank: int,
    deadline: float,
    where: str = "",
    final: bool = False,
    came: set[int] | None = None,
) -> int:
    """Read the arrivals after the first `seen` (their ranks into `came`); JoinError if one's world or shape is
    not this rank's, or two nodes claimed one rank; ForeignEntry for what no rank wrote. Returns how many were
    read. (An arrival is counted before its entry is written: one not there yet is read at the next scan; at the
    `final` check, when every rank has joined, one still missing after TELL_S was never a rank's.)"""
    if store.check(["rayfree/duplicate"]):
        text = store.get("rayfree/duplicate").decode(errors="replace")
        err = JoinError(text) if _DUPLICATE.match(text) else ForeignEntry(rank, where, f"holds {text[:60]!r}")
        if rank == 0:
            _tell_late_ranks(store, err, deadline)
        raise err
    count = int(store.add("rayfree/arrivals", 0))
    keys = [f"rayfree/arrival/{i}" for i in range(seen + 1, count + 1)]
    ready = dict(zip(keys, store.multi_get(keys))) if keys and store.check(keys) else {}  # (one ask: the rule)
    for i, key in enumerate(keys, seen + 1):
        if key not in ready and not store.check([key]):
            if not final:
                return i - 1
            until = min(deadline, time.monotonic() + TELL_S)  # (its rank may be descheduled between the two)
            while not store.check([key]) and time.monotonic() < until:
                time.sleep(_PORT_POLL_S)
            if not store.check([key]):
                raise ForeignEntry(rank, where, f"counts {count} arrivals but has no entry for arrival {i}")
        other = bytes(ready[key] if key in ready else store.get(key)).decode(errors="replace")
        if not _ENTRY.match(other):
            raise ForeignEntry(rank, where, f"holds an arrival no rank wrote ({other[:60]!r})")
        if _fields(other)[4] != _fields(me)[4]:
            err = JoinError(_secrets_differ(me, other))
            if rank == 0:
                _tell_late_ranks(store, err, deadline)
            raise err
        if _world_and_shape(other) != _world_and_shape(me):
            err = JoinError(
                f"the nodes disagree on the cluster's shape: {_describe(me)} but "
                f"{_describe(other)}; start every node with the same sizes (--tp, --pp, --dp, "
                f"--nnodes, ...)"
            )
            if rank == 0:
                _tell_late_ranks(store, err, deadline)
            raise err
        if came is not None:
            came.add(int(_fields(other)[0]))
    return count


def _tell_late_ranks(store, err: JoinError, deadline: float) -> None:
    """Rank 0 (the store's host) stays until every rank any arrival expects has registered and every one that
    came has read the arrivals (`_heard`), or TELL_S: not a fixed wait a descheduled rank may outlast."""
    log.error("%s; keeping the rendezvous open up to %.0fs for ranks still on their way", err, TELL_S)
    until = min(time.monotonic() + TELL_S, deadline)
    try:
        while time.monotonic() < until:
            count = int(store.add("rayfree/arrivals", 0))
            keys = [f"rayfree/arrival/{i}" for i in range(1, count + 1)]
            entries = [store.get(k).decode(errors="replace") for k in keys if store.check([k])]  # (get blocks)
            worlds = [int(_world_and_shape(e)[0]) for e in entries if _ENTRY.match(e)] or [0]
            registered = all(store.check([f"rayfree/join/{r}"]) for r in range(max(worlds)))
            if registered and int(store.add(_TOLD, 0)) >= count - 1:
                return
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - telling them is best effort; the error stands
        return


#: what a rank's entry looks like (rank|world|node|address|fingerprint|shape), and a duplicate claim's text
_ENTRY = re.compile(r"\d+\|\d+\|-?\d+\|[^|]+\|[^|]+\|[^|]*$")
_DUPLICATE = re.compile(r"two nodes claim rank \d+: ")


def _fields(entry: str) -> list[str]:
    """rank, world size, node, address, secret fingerprint, shape."""
    return entry.split("|", 5)


def _world_and_shape(entry: str) -> tuple[str, str]:
    f = _fields(entry)
    return f[1], f[5]


def _secrets_differ(a: str, b: str) -> str:
    """The same line on both nodes: the node that is not node 0 (or the later one) 'uses a different secret'."""
    fa, fb = _fields(a), _fields(b)
    ref, odd = sorted((fa, fb), key=lambda f: (int(f[2]), int(f[0])))

    def name(f: list[str]) -> str:
        return f"node {f[2]} ({f[3]})" if f[2] != "-1" else f"rank {f[0]} ({f[3]})"

    def kind(f: list[str]) -> str:
        return "no cluster secret (--insecure)" if f[4] == "none" else f"secret {f[4]}"

    return (
        f"{name(odd)} uses a different cluster secret than {name(ref)} (fingerprints: {kind(odd)} vs "
        f"{kind(ref)}): give every node the same secret file (--secret-file / RAYFREE_SECRET_FILE; "
        f"`rayfree keygen FILE` once, then copy that file to each node)"
    )


def _describe(entry: str) -> str:
    rank, world, node, _ip, _fp, shape = _fields(entry)
    where = f" on node {node}" if node != "-1" else ""
    return f"rank {rank}{where} has world size {world} ({shape or 'shape unknown'})"
