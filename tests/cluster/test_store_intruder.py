"""A stranger who reaches node 0's master port (torch.distributed's store: no secret guards it) while the cluster
forms: start-up goes on untouched, or fails promptly and within the join's deadline with one line naming the
store. Never a hang."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_multinode import FAST, assert_nothing_left, needs_root
from tests.support.nodes import ROOT, Nodes
from tests.support.paths import PYTHONPATH

JOIN_S = 30.0


def _error_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if "ERROR rayfree.node" in ln), "")


@needs_root
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["junk", "forged-arrival", "forged-duplicate", "deleted-join"])
def test_a_stranger_at_the_store_changes_nothing_or_fails_the_join_naming_the_store(how: str) -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST, RAYFREE_JOIN_TIMEOUT_S=str(JOIN_S))
        lead = nodes.start(0)
        store = f"{sim.nodes[0].ip}:{nodes.values['RAYFREE_MASTER_PORT']}"
        spec = {"host": sim.nodes[0].ip, "port": int(nodes.values["RAYFREE_MASTER_PORT"]), "how": how}
        stranger = sim.nodes[1].popen(
            [sys.executable, "-m", "tests.support.store_intruder", json.dumps(spec)],
            cwd=ROOT, env={"PYTHONPATH": PYTHONPATH, "TORCH_CPP_LOG_LEVEL": "ERROR"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            out, _ = stranger.communicate(timeout=120)
        finally:
            stranger.kill()
        assert stranger.returncode == 0 and f"DONE {how}" in out, out  # it acted while rank 0 waited for rank 1
        t0 = time.monotonic()
        follow = nodes.start(1)
        code_lead, code_follow = lead.wait(JOIN_S + 90), follow.wait(JOIN_S + 90)
        took = time.monotonic() - t0
        assert_nothing_left(sim, [lead, follow])
    if how == "junk":
        assert (code_lead, code_follow) == (0, 0), lead.text()[-3000:] + follow.text()[-2000:]
        m = re.search(r"steps\s+(\d+)\n.*outputs equal to 1-process model\s+(\d+)", lead.text(), re.S)
        assert m and m.group(1) == m.group(2) and int(m.group(1)) > 0, lead.text()[-2000:]
        return
    assert (code_lead, code_follow) == (1, 1), lead.text()[-3000:] + follow.text()[-2000:]
    line = _error_line(lead.text())
    assert store in line and "master port" in line, lead.text()[-3000:]
    assert "curl" not in line or "holds 'please run curl" in line  # a stranger's words are quoted, never said
    assert took <= JOIN_S + 30, f"the nodes failed {took:.0f}s after the follower started (join_timeout_s={JOIN_S})"
    print(f"\n{how}: both nodes exited 1 {took:.1f}s after the follower started: {line.split('ERROR', 1)[1][:200]}")
