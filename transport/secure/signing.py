"""Signed handles: a queue's handle crosses the unauthenticated gloo rendezvous, so `seal` / `unseal` wrap it
in an HMAC made with the cluster secret, with a nonce and a time. A forged one is refused before anything
connects to what it names, and a replayed one (a nonce this process has used, or one older than
RAYFREE_HANDLE_MAX_AGE_S) too. Without a secret (--insecure) a handle goes unsigned.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict

import msgspec

from rayfree import settings

from ..errors import HandleError
from .policy import process_secret

__all__ = ["seal", "unseal", "check_fresh", "MAX_AGE_ENV"]

MAX_AGE_ENV = "RAYFREE_HANDLE_MAX_AGE_S"
_SEAL_MAGIC = b"RFS1"
_lock = threading.Lock()


class _Sealed(msgspec.Struct, array_like=True):
    payload: bytes
    nonce: bytes
    issued: float
    mac: bytes


_seen: OrderedDict[bytes, None] = OrderedDict()
_SEEN_MAX = 100_000


def seal(payload: bytes) -> bytes:
    """`payload` signed with the cluster secret (unchanged when there is none)."""
    s = process_secret()
    if s is None:
        return payload
    nonce, issued = secrets.token_bytes(16), time.time()
    mac = s.mac(_signed_bytes(payload, nonce, issued))
    return _SEAL_MAGIC + msgspec.msgpack.encode(_Sealed(payload, nonce, issued, mac))


def unseal(data: bytes, what: str = "handle") -> tuple[bytes, bytes | None]:
    """(payload, nonce) of `seal(...)`; HandleError if forged, too old, or unsigned while a secret is set.

    Whether the nonce was seen before is the caller's question (`check_fresh`): one process may
    legitimately read a handle twice (for two readers), but not attach the same reader twice.
    """
    s = process_secret()
    if not data.startswith(_SEAL_MAGIC):
        if s is not None:
            raise HandleError(
                f"refused an unsigned {what}: this node has a cluster secret, so every {what} must be "
                f"signed with it (is the sender running without --secret-file?)"
            )
        return data, None
    if s is None:
        raise HandleError(
            f"a signed {what} arrived, but this node has no cluster secret: give it the same "
            f"--secret-file as the others"
        )
    try:
        sealed = msgspec.msgpack.decode(data[len(_SEAL_MAGIC) :], type=_Sealed)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"refused a {what}: its signature envelope is corrupt ({e})") from None
    want = s.mac(_signed_bytes(sealed.payload, sealed.nonce, sealed.issued))
    if not hmac.compare_digest(want, sealed.mac):
        raise HandleError(
            f"refused a {what} signed with another secret: most likely the sending node's cluster "
            f"secret file differs from this node's (copy the same file to every node); if every node "
            f"has the same file, someone else sent it"
        )
    max_age = settings.get(MAX_AGE_ENV)
    age = time.time() - sealed.issued
    if abs(age) > max_age:
        raise HandleError(
            f"refused a replayed {what}: signed {age:.0f}s ago (limit {MAX_AGE_ENV}={max_age:.0f}s; "
            f"check the nodes' clocks)"
        )
    return sealed.payload, sealed.nonce


def check_fresh(nonce: bytes | None, use: str, what: str = "handle") -> None:
    """Refuse the second use `use` (e.g. "reader 2") of the signed message with `nonce` in this process."""
    if nonce is None:
        return
    key = nonce + use.encode()
    with _lock:
        if key in _seen:
            raise HandleError(f"refused a replayed {what}: this process has already used it for {use}")
        _seen[key] = None
        while len(_seen) > _SEEN_MAX:
            _seen.popitem(last=False)


def _signed_bytes(payload: bytes, nonce: bytes, issued: float) -> bytes:
    return msgspec.msgpack.encode((payload, nonce, issued))
