"""MkDocs hooks: the pages that are generated from the code, so they cannot drift from it.

- `<!-- the settings table -->` (settings.md) becomes the table of every RAYFREE_* knob, from
  `rayfree.settings.TABLE`.
- `<!-- the public names -->` (api.md) becomes the API reference of every public name, from the one list
  in `rayfree/__init__.py` (each rendered by mkdocstrings from its docstrings).
"""

from __future__ import annotations

from typing import Any


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


def public_names_reference() -> str:
    by_module: dict[str, list[str]] = {}
    for name, module in public_names().items():
        by_module.setdefault(module, []).append(name)
    out = []
    for module in sorted(by_module):
        out.append(f"## `{module}`\n")
        for name in sorted(by_module[module]):
            out.append(f"::: {module}.{name}\n    options:\n      show_root_heading: true\n      heading_level: 3\n")
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    markdown = markdown.replace("<!-- the settings table -->", settings_table())
    return markdown.replace("<!-- the public names -->", public_names_reference())
