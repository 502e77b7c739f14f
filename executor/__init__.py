"""rayfree executor layer (see DESIGN.md)."""
