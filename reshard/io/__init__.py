"""Bytes in and out: sources (local, stores, HTTP), the rank stream, writers, merge, the pull client."""
