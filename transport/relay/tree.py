"""The broadcast tree over nodes 0..n-1: node 0 sends to at most `fanout` nodes, each of which relays to at
most `fanout` more (a k-ary heap layout), so node 0's copies stay bounded whatever the node count. With
n - 1 <= fanout it is a star: node 0 reaches every node itself, and each node relays only into its own ring.
"""

from __future__ import annotations

__all__ = ["children", "parent", "depth"]


def children(node: int, n: int, fanout: int) -> list[int]:
    """The nodes `node` sends every broadcast to."""
    if fanout < 1:
        raise ValueError(f"a relay fan-out is at least 1, got {fanout}")
    return [c for c in range(node * fanout + 1, node * fanout + fanout + 1) if c < n]


def parent(node: int, fanout: int) -> int:
    """The node `node` receives every broadcast from (node 0 has none: -1)."""
    return -1 if node == 0 else (node - 1) // fanout


def depth(n: int, fanout: int) -> int:
    """Hops from node 0 to the farthest node."""
    d, node = 0, n - 1
    while node > 0:
        node, d = parent(node, fanout), d + 1
    return d
