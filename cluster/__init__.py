"""rayfree cluster layer (see DESIGN.md)."""
