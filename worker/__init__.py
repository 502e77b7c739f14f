"""rayfree's worker layer: the interface an engine's worker implements and the process that runs it.

from .base import WorkerBase
"""

if __name__ != "rayfree.worker":  # the repository's folder imported as a top-level package: two copies of rayfree
    raise ImportError(
        f"import rayfree.worker, not {__name__}: this folder installs as rayfree.worker "
        f"(pip install -e . puts it there)"
    )
