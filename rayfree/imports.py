"""Loading `package.module:name` specs (worker classes, entry points), with errors that say what to fix."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

__all__ = ["load_object", "SpecError"]


class SpecError(ValueError):
    """The spec itself is wrong: not written 'package.module:Name', or its module has no such name. (A module
    that cannot be imported is a plain ValueError: it may be importable elsewhere, where the workers run.)"""


def _load_script(path: str, spec: str, what: str) -> Any:
    """A script named by its path (`driver.py:main`, as torchrun takes one), imported as a module of its own,
    with its directory first on sys.path so it imports its neighbours as it would when run."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise SpecError(f"{what} {spec!r}: no file {full}")
    name = "__rayfree_script_" + os.path.splitext(os.path.basename(full))[0]
    loader_spec = importlib.util.spec_from_file_location(name, full)
    if loader_spec is None or loader_spec.loader is None:
        raise SpecError(f"{what} {spec!r}: {full} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.path.insert(0, os.path.dirname(full))
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the script's own error, named with its file
        del sys.modules[name]
        raise ValueError(f"{what} {spec!r}: running {full} failed: {type(e).__name__}: {e}") from e
    return module


def load_object(spec: str, what: str) -> Any:
    """The object that `spec` ('pkg.mod:Name', 'pkg.mod:Outer.inner', or a script 'path/driver.py:main')
    names; ValueError naming `what`."""
    mod, sep, name = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    if not sep or not mod or not name:
        raise SpecError(f"{what} {spec!r}: write it as 'package.module:Name' (or 'script.py:name')")
    obj: Any
    if mod.endswith(".py") or os.sep in mod:
        obj = _load_script(mod, spec, what)
    else:
        try:
            obj = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"{what} {spec!r}: cannot import {mod!r}: {e}") from e
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"{what} {spec!r}: {mod!r} has no {part!r}") from None
    return obj
