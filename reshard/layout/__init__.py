"""Parallel layouts beyond tensor parallelism: the mesh (`mesh`), each tensor's role (`roles`: pipeline
stage, expert) and the part of it every rank holds (`placement`)."""

from reshard.layout.mesh import Layout

__all__ = ["Layout"]
