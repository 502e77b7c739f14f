"""The pages generated from the code, so they cannot drift from it; also the site's MkDocs hooks.

`python docs/hooks.py` writes them into the checkout, between their markers (tests/ops/test_docs.py fails
when a committed page differs from what this produces), so they read the same on GitHub as in the site:

- settings.md, between `<!-- begin: the settings table -->` and its end marker: every RAYFREE_* knob, from
  `rayfree.settings.TABLE`;
- api.md, between `<!-- begin: the public names -->` and its end marker: every public name of the one list
  in `rayfree/__init__.py`, its signature and docstring. The site renders the same names with mkdocstrings
  instead (`on_page_markdown`).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"settings.md": "the settings table", "api.md": "the public names"}


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if callable(value):
        return "computed (see its description)"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def settings_table() -> str:
    from rayfree import settings

    rows = ["| setting | default | what it does |", "|---|---|---|"]
    for s in settings.TABLE.values():
        rows.append(f"| `{s.name}` | {_default(s.default)} | {s.doc.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def public_names() -> dict[str, str]:
    """public name -> the module that defines it (rayfree's one list)."""
    import rayfree

    return {name: rayfree._EXPORTS[name] for name in rayfree.__all__}


def _by_module() -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = {}
    for name, module in public_names().items():
        by_module.setdefault(module, []).append(name)
    return by_module


def public_names_reference() -> str:
    by_module = _by_module()
    out = []
    for module in sorted(by_module):
        out.append(f"## `{module}`\n")
        for name in sorted(by_module[module]):
            out.append(f"::: {module}.{name}\n    options:\n      show_root_heading: true\n      heading_level: 3\n")
    return "\n".join(out)


def _signature(obj: Any) -> str:
    try:
        return re.sub(r" at 0x[0-9a-f]+>", ">", str(inspect.signature(obj)))  # no address: the page is stable
    except (TypeError, ValueError):
        return "(...)"


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _methods(cls: type) -> list[str]:
    out = []
    members: dict[str, Any] = {}  # its own and those it inherits from rayfree's classes, the base's first
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("rayfree"):
            members.update(klass.__dict__)
    for name, member in members.items():
        if name.startswith("_"):
            continue
        fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not callable(fn) and not isinstance(member, property):
            continue
        sig = (
            ""
            if isinstance(member, property)
            else re.sub(r"^\((self|cls)(, |\))", lambda m: "(" if m.group(2) == ", " else "()", _signature(fn))
        )
        text = _summary(fn)
        out.append(f"- `{name}{sig}`" + (f": {text}" if text else ""))
    return out


def public_names_markdown() -> str:
    """Every public name by module: its signature, its docstring, a class's public methods (plain Markdown)."""
    import importlib

    by_module = _by_module()
    out = []
    for module in sorted(by_module):
        out.append(f"## `{module}`\n")
        for name in sorted(by_module[module]):
            obj = getattr(importlib.import_module(module), name)
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
            out.append(f"### `{name}`\n")
            sig = _signature(obj) if kind != "value" else ""
            out.append(f"{kind} `{name}{sig}`\n")
            doc = inspect.getdoc(obj) or ""
            if doc and (kind != "class" or obj.__doc__):
                out.append(doc.strip() + "\n")
            if kind == "class":
                methods = _methods(obj)
                if methods:
                    out.append("\n".join(methods) + "\n")
    return "\n".join(out)


def _markers(what: str) -> tuple[str, str]:
    return f"<!-- begin: {what} (python docs/hooks.py writes it) -->", f"<!-- end: {what} -->"


def generated(page: str) -> str:
    return settings_table() if page == "settings.md" else public_names_markdown()


def with_block(text: str, what: str, block: str) -> str:
    """`text` with the block between `what`'s markers replaced by `block`."""
    begin, end = _markers(what)
    rx = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not rx.search(text):
        raise ValueError(f"no {begin} ... {end} block")
    return rx.sub(lambda _: f"{begin}\n\n{block.strip()}\n\n{end}", text)


def write_pages() -> list[str]:
    """Write the generated blocks into the checkout's pages; the pages that changed."""
    changed = []
    for page, what in PAGES.items():
        path = os.path.join(ROOT, "docs", page)
        with open(path) as f:
            old = f.read()
        new = with_block(old, what, generated(page))
        if new != old:
            with open(path, "w") as f:
                f.write(new)
            changed.append(page)
    return changed


def on_page_markdown(markdown: str, page: Any = None, **_: Any) -> str:
    src = getattr(getattr(page, "file", None), "src_path", "")
    if src == "api.md":  # the site renders the same names from their docstrings, with cross-references
        return with_block(markdown, PAGES["api.md"], public_names_reference())
    return markdown


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print("wrote " + (", ".join(write_pages()) or "nothing (the pages are up to date)"))
