"""Benchmarks for mlx-gateway (run from the repository root: python -m benchmarks.NAME)."""
