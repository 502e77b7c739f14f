"""A process with a remote reader keeps what ZeroMQ receives in warm memory (transport/heap.py).

Each case runs in a fresh interpreter: glibc's thresholds are process-wide and
move as a process frees memory, so only a new process shows what attaching a
remote reader changed. glibc's own counters (mallinfo2) tell: a 24 MiB block
comes from the heap rather than a fresh mmap, and freeing it leaves it at the
top of the heap rather than handing it back to the kernel.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")

_CHECK = r"""
import ctypes, json, threading
from rayfree.transport import MessageQueue
from rayfree.transport.zmq import heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

w = MessageQueue(1, 0, connect_ip="127.0.0.1")  # one remote reader, over TCP (sealed: the suite has a secret)
r = MessageQueue.create_from_handle(w.export_handle(), 0)
t = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 20})
t.start()
w.wait_until_ready(timeout=20)
t.join(20)
w.enqueue(b"x" * (4 << 20))
assert r.dequeue(timeout=20) == b"x" * (4 << 20)
before = libc.mallinfo2().hblks
p = libc.malloc(24 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(p)
kept = libc.mallinfo2().keepcost
w.close()
r.close()
print(json.dumps({"applied": heap.keep_received_memory_warm(), "mmapped": mmapped, "kept": kept}))
"""


def _run(**env: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", _CHECK], env=e, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(200)
def test_a_remote_reader_keeps_received_memory_warm_and_the_setting_or_the_users_tuning_turns_it_off() -> None:
    on = _run()
    assert on["applied"] is True and on["mmapped"] == 0, f"the 24 MiB block was mmapped: {on}"
    assert on["kept"] >= 24 << 20, f"the freed 24 MiB block went back to the kernel: {on}"
    # glibc's defaults, as the process had them: the block is mmapped and unmapped again
    off = _run(RAYFREE_HEAP_TUNE="0")
    assert off["applied"] is False and off["mmapped"] == 1 and off["kept"] < 24 << 20, off
    # a user who tunes malloc through the environment keeps their own settings
    theirs = _run(MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_=str(1 << 20))
    assert theirs["applied"] is False and theirs["kept"] < 24 << 20, theirs
