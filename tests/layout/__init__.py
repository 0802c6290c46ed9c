"""Tests of layouts beyond tensor parallelism: pipeline stages, FSDP, expert parallelism."""
