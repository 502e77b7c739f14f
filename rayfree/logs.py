"""Log set-up for rayfree's own processes (nodes, workers): one format, the level from RAYFREE_LOG_LEVEL."""

from __future__ import annotations

import logging
import sys

from . import settings

__all__ = ["configure"]

#: Every line carries its process's place in the layout (Worker_PP1_TP0, MainProcess) and pid.
FORMAT = "(%(processName)s pid=%(process)d) %(levelname)s %(name)s: %(message)s"


def configure(fmt: str = FORMAT) -> None:
    """Log to stderr at RAYFREE_LOG_LEVEL unless the process has configured logging itself."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=settings.get("RAYFREE_LOG_LEVEL").upper(), stream=sys.stderr, format=fmt)
