"""Poll an HTTP health endpoint and print every change of its answer with the time (CLOCK_MONOTONIC, the
same in every network namespace): `python probe.py URL [PERIOD_S]`. The polling period is the probe's
resolution, as a kubelet's is."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request


def main() -> None:
    url, period = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    last = None
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                code, body = r.status, r.read().decode().strip()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode().strip()
        except OSError as e:
            code, body = 0, f"{type(e).__name__}: {e}"
        if code != last:
            print(f"PROBE {code} {time.monotonic():.3f} {body}", flush=True)
            last = code
        time.sleep(period)


if __name__ == "__main__":
    main()
