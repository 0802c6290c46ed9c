"""Synthetic checkpoints for tests, the demo and the benchmarks."""
