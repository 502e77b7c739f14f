"""rayfree's worker layer: the interface an engine's worker implements and the process that runs it.

    from worker.base import WorkerBase
"""
