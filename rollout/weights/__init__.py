"""Weights: their state and checksums, pushes and syncs, hot swaps, the files they come from."""
