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
]


def _private_names(path: str) -> set[str]:
    """What a class keeps to itself: its `_x` methods and the `self._x` attributes it sets."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store) and _private(node.attr):
                out.add(node.attr)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(path: str, names: set[str]) -> list[tuple[int, str]]:
    """Where a module reads one of `names` off anything but `self`, `cls` or a class it names (the ast, so an
    expression like `raised[0][0]._stop_reason` is seen as well as `ex._stop_reason`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not (isinstance(node.value, ast.Name) and (node.value.id in ("self", "cls") or node.value.id[:1].isupper()))
    ]


def test_no_module_reads_the_executors_private_state() -> None:
    mine = os.path.join(ROOT, "executor", "multiproc.py")
    names = _private_names(mine)
    assert {"_stop_reason", "_failure", "_closing"} <= names, names
    bad = [
        f"{os.path.relpath(path, ROOT)}:{line} reads {text}"
        for path in _modules().values()
        if path != mine
        for line, text in _reaches(path, names)
    ]
    assert not bad, "\n".join(bad)


def test_the_private_state_check_sees_through_any_expression(tmp_path) -> None:
    probe = tmp_path / "m.py"
    probe.write_text("x = raised[0][0]._stop_reason\ny = self._stop_reason\nz = MultiprocExecutor._finalize\n")
    assert _reaches(str(probe), {"_stop_reason", "_finalize"}) == [(1, "raised[0][0]._stop_reason")]


def _thread_calls(path: str) -> list[int]:
    """Lines that make a thread: `threading.Thread(...)`, or `Thread(...)` imported from threading."""
    with open(path) as f:
        tree = ast.parse(f.read())
    bare = any(
        isinstance(n, ast.ImportFrom) and n.module == "threading" and any(a.name == "Thread" for a in n.names)
        for n in ast.walk(tree)
    )
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == "Thread" and ast.unparse(n.func.value) == "threading")
            or (bare and isinstance(n.func, ast.Name) and n.func.id == "Thread")
        )
    ]


def test_every_thread_is_started_by_the_supervisor() -> None:
    """One owner for every background thread (rayfree/supervisor.py): no other module makes one."""
    where = {os.path.relpath(p, ROOT): _thread_calls(p) for p in _modules().values()}
    assert where.pop("rayfree/supervisor.py"), "the supervisor itself makes its threads"
    bad = {path: lines for path, lines in where.items() if lines}
    assert not bad, f"threads started outside rayfree/supervisor.py (use supervisor().start): {bad}"


def _thread_names(path: str) -> list[str]:
    """The names of the threads `supervisor().start(...)` calls in a file start, `{...}` as `<x>`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "start"
            and isinstance(node.func.value, ast.Call)
            and getattr(node.func.value.func, "id", "") == "supervisor"
        ):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant):
                out.append(arg.value)
            elif isinstance(arg, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in arg.values))
            else:
                out.append(ast.unparse(arg) if arg is not None else "?")
    return out


def test_every_thread_the_library_starts_is_in_the_architecture_pages_table() -> None:
    """docs/architecture.md, "Threads and who stops them", lists every thread by name: each name a
    `supervisor().start` in the library gives is a row there (`<n>` and the like match any placeholder)."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        section = f.read().split("## Threads and who stops them", 1)[1].split("\n## ", 1)[0]
    rows = {re.sub(r"<\w+>", "<x>", n) for n in re.findall(r"^\| `(Rayfree[\w<>-]+)` \|", section, re.M)}
    started = {n: os.path.relpath(p, ROOT) for p in _modules().values() for n in _thread_names(p)}
    started.pop("self._name", None)  # (the heartbeat threads: named by their class, both rows of the table)
    missing = {n: where for n, where in started.items() if n not in rows}
    assert len(started) >= 10 and not missing, f"threads the table lacks: {missing}"


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


def test_inside_a_layer_modules_import_each_other_relatively() -> None:
    """So the structure of each layer is visible to tools that read imports; across layers, `rayfree.<layer>`."""
    bad = []
    for name, path in _modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in ("transport", "cluster", "worker", "executor"):
            continue
        own = f"rayfree.{parts[1]}"
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [
                f"{os.path.relpath(path, ROOT)}:{node.lineno} {m}" for m in mods if m == own or m.startswith(own + ".")
            ]
    assert not bad, "absolute imports of the module's own layer:\n" + "\n".join(bad)


def _dead_overrides(path: str, base: type) -> list[str]:
    """Methods a subclass of `base` (named in its bases) defines that `base` has no method of: nothing calls them."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        if base.__name__ not in {getattr(b, "id", getattr(b, "attr", None)) for b in cls.bases}:
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and not hasattr(base, fn.name):
                out.append(f"{os.path.relpath(path, ROOT)}:{fn.lineno} {cls.name}.{fn.name}")
    return out


def test_a_subclass_of_the_executor_overrides_only_what_the_executor_calls() -> None:
    """The vLLM integration's cleanup once its workers are gone lived in a method the executor stopped calling."""
    from rayfree.executor.multiproc import MultiprocExecutor

    bad = [d for p in _modules().values() for d in _dead_overrides(p, MultiprocExecutor)]
    assert not bad, f"methods MultiprocExecutor never calls: {bad}"


def test_the_override_check_sees_a_method_the_executor_lacks(tmp_path) -> None:
    from rayfree.executor.multiproc import MultiprocExecutor

    f = tmp_path / "m.py"
    f.write_text("class E(MultiprocExecutor):\n    def release(self): ...\n    def _shutdown(self): ...\n")
    assert [d.split()[-1] for d in _dead_overrides(str(f), MultiprocExecutor)] == ["E._shutdown"]


def test_tests_and_benches_prepend_to_pythonpath_never_replace_it() -> None:
    """rayfree's dependencies may come from PYTHONPATH (a `pip install --target` directory, an HPC module
    system): a child process started with a PYTHONPATH of the checkout alone would not find them."""
    replaced = re.compile(r"""["']PYTHONPATH["']\s*(?:\]\s*=|:)\s*(?:ROOT|root|f["']\{ROOT\})(?!\s*\+)""")
    bad = []
    for folder in ("tests", "bench", "docker", "examples", "rayfree"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path) as src:
                        bad += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(src, 1)
                                if replaced.search(line)]  # fmt: skip
    assert not bad, f"a PYTHONPATH replaced, not prepended to: {bad}"
