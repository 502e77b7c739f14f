"""The house's rules, read from the source: no import cycle (TYPE_CHECKING imports too), and no room's insides
reached from outside it."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: installed name -> folder
ROOTS = {
    "rayfree": "rayfree",
    "rayfree.transport": "transport",
    "rayfree.cluster": "cluster",
    "rayfree.worker": "worker",
    "rayfree.executor": "executor",
}


def _modules() -> dict[str, str]:
    """Every library module: dotted name -> path."""
    out = {}
    for pkg, folder in ROOTS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            if pkg == "rayfree" and rel.split(os.sep)[0] in ("transport", "cluster", "worker", "executor"):
                continue
            base = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    out[base if f == "__init__.py" else f"{base}.{f[:-3]}"] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The library modules `name` imports anywhere in its file (a package's own parents are implied, not edges)."""
    is_pkg = path.endswith("__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def test_no_import_cycle_anywhere_in_the_library_type_checking_imports_included() -> None:
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    graph["rayfree"] = set()  # its TYPE_CHECKING block is the list of public names, loaded lazily (PEP 562)
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(known) > 60 and sum(map(len, graph.values())) > 150  # the walk found the library
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_a_cycle_is_caught_by_the_walk(tmp_path) -> None:
    """The check can fail: two modules importing each other under TYPE_CHECKING are an edge each way."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rayfree.x.b import B\n")
    b.write_text("from rayfree.x.a import A\n")
    known = {"rayfree.x.a": str(a), "rayfree.x.b": str(b)}
    assert _imports("rayfree.x.a", str(a), known) == {"rayfree.x.b"}
    assert _imports("rayfree.x.b", str(b), known) == {"rayfree.x.a"}


#: (what, pattern, the rooms allowed to use it)
INSIDES = [
    (
        "the ring's flags or mapping",
        r"\.(rw|rr)\.|\._mm\b|set_parked\(|\bRingWriter\b|\bRingReader\b",
        ("transport/shm/",),
    ),
    (
        "a ZeroMQ socket",
        r"^\s*import zmq\b|\bzmq\.Socket\b|\.setsockopt\(zmq\.|send_multipart\(|recv_multipart\(",
        ("transport/zmq/", "transport/secure/"),
    ),
    ("an executor's private state", r"\b(ex|executor|exe|me)\._[a-z]", ("executor/multiproc.py",)),
]


def test_nothing_reaches_into_a_room_from_outside_it() -> None:
    bad = []
    for path in _modules().values():
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            text = f.read()
        for what, pattern, rooms in INSIDES:
            if rel.startswith(rooms):
                continue
            for m in re.finditer(pattern, text, re.M):
                line = text[: m.start()].count("\n") + 1
                bad.append(f"{rel}:{line} reaches {what}: {m.group(0).strip()}")
    assert not bad, "\n".join(bad)


def test_no_module_is_over_400_lines() -> None:
    long = {}
    for path in _modules().values():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > 400:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, long
