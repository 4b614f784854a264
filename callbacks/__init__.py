"""Built-in lppo callbacks (one per file)."""
