"""An editor that opens this checkout with its venv goes to the definition of rayfree's public names in the
repository's files. jedi (the completion engine behind many editors) does not run the editable install's import
hook, so the package reaches its four layers through links in rayfree/ (rayfree/transport -> ../transport, ...)."""

from __future__ import annotations

import os
import sys

import pytest

jedi = pytest.importorskip("jedi")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("code", "where"),
    [
        ("import rayfree\nrayfree.MultiprocExecutor", "executor/multiproc.py"),
        ("import rayfree.transport\nrayfree.transport.MessageQueue", "transport/queue/message_queue.py"),
        ("import rayfree.cluster\nrayfree.cluster.ClusterConfig", "cluster/config.py"),
    ],
)
def test_an_editor_goes_to_the_definition_in_the_checkout(code: str, where: str, tmp_path) -> None:
    env = jedi.create_environment(sys.prefix, safe=False)
    script = jedi.Script(code, path=str(tmp_path / "engine.py"), environment=env)
    last = code.split("\n")[-1]
    found = script.goto(len(code.split("\n")), len(last) - 1, follow_imports=True)
    paths = [os.path.realpath(str(d.module_path)) for d in found if d.module_path is not None]
    assert paths == [os.path.join(ROOT, where)], (last, paths)


def test_the_links_are_the_layers() -> None:
    for layer in ("transport", "cluster", "worker", "executor"):
        link = os.path.join(ROOT, "rayfree", layer)
        assert os.path.islink(link) and os.readlink(link) == f"../{layer}", link
