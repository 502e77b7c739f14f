"""The documentation: a README a newcomer reads in a minute, every page in the site, and the pages generated
from the code (settings, public names) saying what the code says."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

import pytest
import yaml

import rayfree
from rayfree import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nav() -> list[str]:
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        conf = yaml.safe_load(f)

    def pages(items: list) -> list[str]:
        out: list[str] = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += pages(value) if isinstance(value, list) else [value]
        return out

    return pages(conf["nav"])


def test_the_readme_is_at_most_8_kib_and_links_only_to_pages_that_exist() -> None:
    path = os.path.join(ROOT, "README.md")
    assert os.path.getsize(path) <= 8192, os.path.getsize(path)
    with open(path) as f:
        links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", f.read())
    assert links and all(os.path.exists(os.path.join(ROOT, link)) for link in links), links


def test_every_page_is_in_the_site_and_every_entry_is_a_page() -> None:
    docs = os.path.join(ROOT, "docs")
    pages = {os.path.relpath(os.path.join(d, f), docs) for d, _, fs in os.walk(docs) for f in fs if f.endswith(".md")}
    assert set(_nav()) == pages


def test_the_settings_page_has_one_row_per_setting_with_its_default() -> None:
    table = _hooks().settings_table()
    rows = re.findall(r"^\| `(RAYFREE_[A-Z0-9_]+)` \| ([^|]+) \|", table, re.M)
    assert [name for name, _ in rows] == list(settings.TABLE)
    defaults = dict(rows)
    assert defaults["RAYFREE_SPIN_US"].strip() == "200.0" and defaults["RAYFREE_SECRET_FILE"].strip() == "unset"
    with open(os.path.join(ROOT, "docs", "settings.md")) as f:
        assert table.strip() in f.read()  # in the checkout too, not only in the built site


def test_the_api_page_lists_every_public_name_and_no_other() -> None:
    hooks = _hooks()
    names = hooks.public_names()
    assert sorted(names) == rayfree.__all__ and len(names) > 40
    ref = hooks.public_names_reference()
    assert set(re.findall(r"^::: [\w.]+\.(\w+)$", ref, re.M)) == set(rayfree.__all__)
    for name, module in names.items():
        assert getattr(importlib.import_module(module), name) is getattr(rayfree, name)
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        page = f.read()
    assert set(re.findall(r"^### `(\w+)`$", page, re.M)) == set(rayfree.__all__)  # readable in the checkout


@pytest.mark.parametrize("page", ["settings.md", "api.md"])
def test_the_generated_pages_in_the_checkout_are_what_the_code_says(page: str) -> None:
    """`python docs/hooks.py` writes them; a setting or a docstring changed without it fails here."""
    hooks = _hooks()
    with open(os.path.join(ROOT, "docs", page)) as f:
        text = f.read()
    assert hooks.with_block(text, hooks.PAGES[page], hooks.generated(page)) == text, (
        f"docs/{page} is out of date: run `python docs/hooks.py`"
    )


@pytest.mark.parametrize("page", ["architecture.md", "operations.md"])
def test_the_design_pages_cover_what_a_newcomer_needs(page: str) -> None:
    with open(os.path.join(ROOT, "docs", page)) as f:
        heads = set(re.findall(r"^#+ (.+)$", f.read(), re.M))
    want = {
        "architecture.md": {"Layers", "Wire formats", "Memory ordering", "Fault model", "Where things live"},
        "operations.md": {"Several nodes", "Security", "Seeing into a running cluster"},
    }[page]
    assert want <= heads, want - heads
