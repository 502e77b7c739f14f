"""The cluster secret: the root of the queues' seals (aead.py), the heartbeats' CURVE keys, and handle signatures.

vLLM's multi-node queue let anyone who could reach its publisher run code on
every worker (its readers unpickle whatever arrives). Here a TCP socket exists
only with a cluster secret (`rayfree keygen`), unless the user explicitly opts
out with --insecure. From the secret every node derives the same keys: each
queue's sealing key and its subscribers' admission tokens (`derive`, used by
aead.py, writer.py, reader.py), and two CURVE key pairs for the heartbeat
sockets, whose ZAP handler admits only the client key.

Handles cross the unauthenticated gloo rendezvous: signing.py signs them with
the secret's MAC.

Policy (who needs a secret) lives here; the sockets apply it in sockets.py.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from typing import Any, NamedTuple

import zmq
import zmq.utils.z85

from rayfree import settings

from ..errors import TransportError

__all__ = [
    "ClusterSecret",
    "InsecureTransport",
    "SecretError",
    "secret_from",
    "fingerprint",
    "Policy",
    "resolve",
    "use",
    "current",
    "load_secret",
    "write_secret",
    "process_secret",
    "insecure",
    "require_secret",
    "SECRET_FILE_ENV",
    "INSECURE_ENV",
    "DOCKER_SECRET",
]

logger = logging.getLogger("rayfree.security")

SECRET_FILE_ENV = "RAYFREE_SECRET_FILE"
INSECURE_ENV = "RAYFREE_INSECURE"
#: Where `docker compose` mounts a secret named rayfree_secret.
DOCKER_SECRET = "/run/secrets/rayfree_secret"
_MIN_BYTES = 32


class InsecureTransport(TransportError):
    """A TCP socket was needed, but there is no cluster secret and --insecure was not given."""


class SecretError(TransportError):
    """The cluster secret given cannot be used (a file missing, unreadable or too short): `problem` names it,
    `fix` says what to do; the message is both."""

    def __init__(self, problem: str, source: str = "memory") -> None:
        self.problem = problem
        self.fix = (
            f"make one with `rayfree keygen {source}` on one node and copy that file to every node (or "
            f"point --secret-file / {SECRET_FILE_ENV} at the file you copied)"
            if source != "memory"
            else "make one with `rayfree keygen FILE`"
        )
        super().__init__(f"{problem}; {self.fix}")


class ClusterSecret:
    """The shared secret and what is derived from it. Never logged, never put in argv."""

    def __init__(self, raw: bytes, source: str = "memory") -> None:
        if len(raw) < _MIN_BYTES:
            raise SecretError(
                f"the cluster secret from {source} has {len(raw)} bytes; it needs at least {_MIN_BYTES}", source
            )
        self._raw = raw
        self.source = source
        self.server_public, self.server_secret = self._curve_pair(b"curve-server")
        self.client_public, self.client_secret = self._curve_pair(b"curve-client")
        self._mac_key = self.derive(b"handle-mac")

    def derive(self, label: bytes) -> bytes:
        return hmac.new(self._raw, b"rayfree/" + label, hashlib.sha256).digest()

    def _curve_pair(self, label: bytes) -> tuple[bytes, bytes]:
        secret_z85 = zmq.utils.z85.encode(self.derive(label))
        return zmq.curve_public(secret_z85), secret_z85

    def mac(self, data: bytes) -> bytes:
        return hmac.new(self._mac_key, data, hashlib.sha256).digest()

    @property
    def fingerprint(self) -> str:
        """A short public tag of the secret (one-way, a label of its own): nodes compare it to tell a copied-
        wrong secret file from an attack. It proves nothing; it only helps name the mistake."""
        return self.derive(b"fingerprint").hex()[:12]

    def __repr__(self) -> str:
        return f"ClusterSecret(from {self.source})"


def write_secret(path: str) -> None:
    """A new random secret in a new file, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def _read(path: str) -> ClusterSecret:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError as e:
        raise SecretError(f"cannot read the cluster secret {path}: {e.strerror}", path) from None
    secret = _parse(text, path)  # a file that cannot be used is refused before anything is said about its mode
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) and not path.startswith("/run/secrets/"):
        logger.warning(
            "cluster secret %s is readable by others (mode %o): chmod 600 it", path, stat.S_IMODE(st.st_mode)
        )
    return secret


def _parse(text: bytes, source: str) -> ClusterSecret:
    """A key file's text (hex, as `rayfree keygen` writes it) or raw bytes."""
    try:
        raw = bytes.fromhex(text.decode())
    except (ValueError, UnicodeDecodeError):
        raw = text
    return ClusterSecret(raw, source)


def secret_from(secret: bytes | str | os.PathLike[str] | ClusterSecret) -> ClusterSecret:
    """The secret an engine gives from Python: its bytes (or a key file's text), a path to its file, or one
    already loaded. SecretError when it cannot be used."""
    if isinstance(secret, ClusterSecret):
        return secret
    if isinstance(secret, (bytes, bytearray, memoryview)):
        raw = bytes(secret)  # hex text (a key file's) may end in a newline; random bytes are taken as they are
        try:
            return ClusterSecret(bytes.fromhex(raw.strip().decode()), "memory")
        except (ValueError, UnicodeDecodeError):
            return ClusterSecret(raw, "memory")
    if isinstance(secret, (str, os.PathLike)):
        return _read(os.fspath(secret))
    raise TypeError(f"secret must be bytes, a path or a ClusterSecret, got {type(secret).__name__}")


def fingerprint() -> str:
    """This process's secret's fingerprint ('none' without a secret)."""
    s = process_secret()
    return "none" if s is None else s.fingerprint


def load_secret(path: str | None = None, env: Any = None) -> ClusterSecret | None:
    """`path`, else RAYFREE_SECRET_FILE, else the docker secret if mounted; None if there is none."""
    path = path or settings.get(SECRET_FILE_ENV, env)
    if path:
        return _read(path)
    if os.path.exists(DOCKER_SECRET):
        return _read(DOCKER_SECRET)
    return None


class Policy(NamedTuple):
    """Who may talk to whom over TCP: with `secret`, CURVE and signed handles; without, only if `insecure`."""

    secret: ClusterSecret | None
    insecure: bool


def resolve(secret_file: str | None = None, insecure: bool | None = None, env: Any = None) -> Policy:
    """The one policy for node, executor and doctor: --secret-file, else RAYFREE_SECRET_FILE, else the compose
    secret; --insecure, else RAYFREE_INSECURE."""
    on = settings.get(INSECURE_ENV, env) if insecure is None else insecure
    return Policy(load_secret(secret_file, env), bool(on))


_lock = threading.Lock()
_explicit: Policy | None = None
_cached: tuple[str | None, bool, Policy] | None = None
_warned = False


def use(policy: Policy | None) -> None:
    """Make `policy` this process's (None: back to the environment's). The executor hands its own to every
    worker it starts, so nothing is passed through os.environ."""
    global _explicit
    with _lock:
        _explicit = policy


def current() -> Policy:
    """This process's policy: the one given to `use`, else the environment's (read once per secret file)."""
    global _cached
    with _lock:
        if _explicit is not None:
            return _explicit
        key = settings.get(SECRET_FILE_ENV) or (DOCKER_SECRET if os.path.exists(DOCKER_SECRET) else None)
        flag = settings.get(INSECURE_ENV)
        if _cached is None or _cached[0] != key or _cached[1] != flag:
            _cached = (key, flag, resolve())
        return _cached[2]


def process_secret() -> ClusterSecret | None:
    """This process's cluster secret, if it has one."""
    return current().secret


def insecure() -> bool:
    """--insecure / RAYFREE_INSECURE=1: plain TCP without a secret (logged as a warning, once per process)."""
    global _warned
    on = current().insecure
    if on and not _warned:
        _warned = True
        logger.warning(
            "INSECURE: TCP sockets are neither authenticated nor encrypted (--insecure / %s=1); anyone "
            "who reaches them can read the broadcasts and run code on the workers",
            INSECURE_ENV,
        )
    return on


def require_secret(what: str) -> ClusterSecret | None:
    """The secret for a TCP socket; None in insecure mode; InsecureTransport when neither."""
    s = process_secret()
    if s is not None:
        return s
    if insecure():
        return None
    raise InsecureTransport(
        f"{what} needs TCP, and TCP needs a cluster secret: run `rayfree keygen FILE` once, "
        f"give every node that file (--secret-file FILE or {SECRET_FILE_ENV}=FILE; in compose, "
        f"the rayfree_secret secret), or pass --insecure ({INSECURE_ENV}=1) on a trusted network"
    )
