"""Slurm's compressed host lists (`gpu[01-04,07]`, `a[1-2]-b[3-4]`), expanded as `scontrol show hostnames` does."""

from __future__ import annotations

import itertools

__all__ = ["expand_hostlist", "HostlistError"]


class HostlistError(ValueError):
    """The text is not a host list Slurm would write; the message quotes the part that is wrong."""


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"host list {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"host list {text!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _range(body: str, whole: str) -> list[str]:
    """`01-04,07` -> ['01', '02', '03', '04', '07'] (zero padding kept, as Slurm keeps it)."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"host list {whole!r}: [{body}] is not a list of numbers and ranges")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise HostlistError(f"host list {whole!r}: range {item.strip()} goes down")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(a, b + 1)]
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    """One comma-free pattern; several bracket groups multiply, the first varying slowest."""
    pieces: list[list[str]] = []
    rest = pattern
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        pieces += [[head], _range(body, whole)]
    pieces.append([rest])
    return ["".join(p) for p in itertools.product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """Every host of a Slurm host list, in Slurm's order (duplicates kept, as srun keeps them)."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        hosts += _expand_one(part, text)
    if not hosts:
        raise HostlistError(f"host list {text!r} names no host")
    return hosts
