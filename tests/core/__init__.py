"""Tests of the reshard core: formats, rules, plans, the stream and the writer (CPU only)."""
