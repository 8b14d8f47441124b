"""Generated wire protocol (orchard.v1)."""
