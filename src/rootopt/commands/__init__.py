"""Command implementations for the ``rootopt`` CLI (top layer: may import any component)."""
