"""Loading `package.module:name` specs (worker classes, entry points), with errors that say what to fix."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_object", "SpecError"]


class SpecError(ValueError):
    """The spec itself is wrong: not written 'package.module:Name', or its module has no such name. (A module
    that cannot be imported is a plain ValueError: it may be importable elsewhere, where the workers run.)"""


def load_object(spec: str, what: str) -> Any:
    """The object that `spec` ('pkg.mod:Name' or 'pkg.mod:Outer.inner') names; ValueError naming `what`."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise SpecError(f"{what} {spec!r}: write it as 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {mod!r}: {e}") from e
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"{what} {spec!r}: {mod!r} has no {part!r}") from None
    return obj
