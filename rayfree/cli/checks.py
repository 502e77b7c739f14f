"""`Check`: one line of `rayfree doctor`'s report, whichever room made it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Check"]


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn", "FAIL"
    detail: str
    fix: str = ""
