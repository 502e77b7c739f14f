"""The docs' `my_engine.worker:Worker`: the toy engine's worker, plus the methods the docs' snippets call."""

from __future__ import annotations

from typing import Any

from rayfree.cli.toy_engine import ToyWorker


class Worker(ToyWorker):
    """Worker kwargs: `model` (a name, kept for show), and the toy engine's (n_layers, d_model, d_hidden, seed)."""

    def load_lora(self, adapter: Any) -> int:
        """Stands in for loading an adapter: keeps it and answers with this rank."""
        self.adapter = adapter
        return self.rank
