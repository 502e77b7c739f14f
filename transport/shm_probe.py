"""Same node means "can open the same shared-memory segment": a probe, not a hostname guess.

The source creates a tiny segment holding a random token; every other
process tries to open it and compare the token. Two network namespaces that
share /dev/shm are honestly one node; two containers with private /dev/shm
are two, whatever their hostnames say.
"""

from __future__ import annotations

import mmap
import os
import secrets

from .shm_ring import SEGMENT_PREFIX, shm_open, unlink_segment

__all__ = ["create_probe", "check_probe", "remove_probe"]

_TOKEN_BYTES = 16


def create_probe() -> tuple[str, bytes]:
    """Make a probe segment; returns (name, token). Remove it with `remove_probe`."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}-probe-{secrets.token_hex(6)}"
    token = secrets.token_bytes(_TOKEN_BYTES)
    fd = shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, _TOKEN_BYTES)
        with mmap.mmap(fd, _TOKEN_BYTES) as m:
            m[:] = token
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)
    return name, token


def check_probe(name: str, token: bytes) -> bool:
    """True if this process sees the probe segment `name` holding `token`."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name:
        return False
    try:
        fd = shm_open(name, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != _TOKEN_BYTES:
            return False
        with mmap.mmap(fd, _TOKEN_BYTES, prot=mmap.PROT_READ) as m:
            return m[:] == token
    finally:
        os.close(fd)


def remove_probe(name: str) -> None:
    unlink_segment(name)
