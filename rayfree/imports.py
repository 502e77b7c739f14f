"""Loading `package.module:name` specs (worker classes, entry points), with errors that say what to fix."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import threading
from typing import Any

__all__ = ["load_object", "SpecError", "check_spec", "split_spec", "class_literal"]


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
    mod, name = split_spec(spec, what)
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


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """'pkg.mod:Name' (or 'path/driver.py:name', a drive letter's colon kept) as (module, name); SpecError
    naming `what` when it is not of that form."""
    mod, sep, name = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    if not sep or not mod or not name:
        raise SpecError(f"{what} {spec!r}: write it as 'package.module:Name' (or 'script.py:name')")
    return mod, name


#: CPython 3.11's AST conversion keeps its recursion depth in the interpreter, not the thread: two threads
#: parsing at once (a node's DP replicas start side by side) fail with "AST constructor recursion depth mismatch"
_PARSE_LOCK = threading.Lock()


def _module_source(mod: str) -> tuple[bytes, ast.Module] | None:
    """A module's source and its parse, found without importing it (None: a script path, no .py source here,
    or it does not parse)."""
    if mod.endswith(".py") or os.sep in mod:
        return None
    try:
        found = importlib.util.find_spec(mod)
        if found is None or not found.origin or not found.origin.endswith(".py"):
            return None
        with open(found.origin, "rb") as f:
            source = f.read()
        with _PARSE_LOCK:
            return source, ast.parse(source, found.origin)
    except (ImportError, ValueError, OSError, SyntaxError):
        return None


def check_spec(spec: str, what: str) -> bool | None:
    """Is `spec` ('pkg.mod:Name') right, judged without running its module (which may import torch: a node
    process that only starts workers has no use for it)? True: its module's source defines or imports the name
    at top level; SpecError: the form is wrong, or the source surely lacks the name (or defines a function
    where a class is asked for); None: it cannot tell (no source here, a module-level __getattr__ or `import
    *`, names made as it runs, a script path), and the caller imports it or leaves it to the workers."""
    mod, name = split_spec(spec, what)
    if mod in sys.modules:
        return None
    parsed = _module_source(mod)
    if parsed is None:
        return None
    source, tree = parsed
    if any(w in source for w in (b"globals()", b"exec(", b"setattr(sys.modules", b"sys.modules[__name__]")):
        return None  # it makes names as it runs: only an import tells
    top = name.split(".")[0]
    kinds: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            kinds[node.name] = "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kinds[node.name] = "function" if node.name != "__getattr__" else "getattr"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                kinds[(a.asname or a.name).split(".")[0]] = "*" if a.name == "*" else "other"
        else:  # assignments, and anything defined or imported under a top-level if / try
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    kinds.setdefault(sub.id, "other")
                elif isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kinds.setdefault(sub.name, "other")
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    for a in sub.names:
                        kinds.setdefault((a.asname or a.name).split(".")[0], "*" if a.name == "*" else "other")
    if top in kinds:
        if what == "worker class" and "." not in name and kinds[top] == "function":
            raise SpecError(f"{what} {spec!r}: {name!r} in {mod!r} is a function, not a class")
        return True
    if "getattr" in kinds.values() or "*" in kinds.values():
        return None
    raise SpecError(f"{what} {spec!r}: {mod!r} has no {top!r}")


def class_literal(spec: str, attr: str) -> object | None:
    """The literal a class named by `spec` ('pkg.mod:Class') assigns to `attr` in its own body, read from its
    module's source without running it (None: not found that way: no source, not a literal, or inherited)."""
    try:
        mod, name = split_spec(spec, "class")
    except SpecError:
        return None
    parsed = _module_source(mod)
    for node in parsed[1].body if parsed is not None else []:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
                    item, ast.AnnAssign) else []  # fmt: skip
                value = getattr(item, "value", None)
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets) and isinstance(value, ast.Constant):
                    return value.value
    return None
