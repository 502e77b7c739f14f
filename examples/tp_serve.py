"""An engine's entry point for `rayfree node --entry tp_serve:main` (examples/test_simulated_cluster.py runs it
on two simulated nodes): a few steps of the tensor-parallel layer of tp_layer.py, each checked against the
unsharded layer, and one line of JSON saying how it went; then, with TP_SERVE_IDLE_S, idle that long (as an
engine between requests)."""

from __future__ import annotations

import json
import os
import time

import torch
from tp_layer import IN, full_layer


def main(ex) -> int:
    layer = full_layer()
    ok = 0
    for step in range(10):
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(step))
        ok += bool(torch.allclose(ex.execute_model(x), layer(x).detach(), atol=1e-4))
    nodes = sorted({info["node"] for info in ex.collective_rpc(_where, timeout=60)})
    print("RESULT:" + json.dumps({"steps": 10, "equal": ok, "nodes": nodes}), flush=True)
    time.sleep(float(os.environ.get("TP_SERVE_IDLE_S", "0")))  # an engine idle between requests, if asked
    return 0 if ok == 10 else 1


def _where(worker) -> dict:
    from rayfree.worker.proc import worker_info

    return worker_info(worker)
