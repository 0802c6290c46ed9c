"""Side-by-side benchmarks of reshard against baselines measured in the same run (see bench/run.py)."""
