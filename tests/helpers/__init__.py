"""Shared test helpers: oracles that raise the real OOM error types, datasets, the Lightning namespace."""
