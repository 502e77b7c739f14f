"""Poll an HTTP health endpoint and print every change of its answer with the time (CLOCK_MONOTONIC, the
same in every network namespace): `python probe.py URL [PERIOD_S]`. The polling period is the probe's
resolution, as a kubelet's is."""

from __future__ import annotations

import http.client
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
            try:
                code, body = e.code, e.read().decode().strip()
            except (OSError, http.client.HTTPException) as gone:  # the process left in the middle of the answer
                code, body = 0, f"{type(gone).__name__}: {gone}"
        except (OSError, http.client.HTTPException) as e:  # (IncompleteRead: it left while it answered)
            code, body = 0, f"{type(e).__name__}: {e}"
        if code != last:
            print(f"PROBE {code} {time.monotonic():.3f} {body}", flush=True)
            last = code
        time.sleep(period)


if __name__ == "__main__":
    main()
