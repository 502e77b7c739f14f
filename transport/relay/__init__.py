"""A node's relay: one stream in from its parent node, its shared-memory ring out to its own readers, and the
same stream passed on unchanged to its child nodes (a k-ary tree past the fan-out). The shape of the tree is
`tree.py`'s; the relay itself (a receiver and two senders of the rooms below) is `relay.py`'s.
"""
