"""Benchmarks: each script prints one JSON document comparing its figures side by side (see README)."""
