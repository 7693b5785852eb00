"""Storage helpers shared by checkpoints, shards and staging (no torch here)."""
