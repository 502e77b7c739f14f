"""rayfree worker layer (see DESIGN.md)."""
