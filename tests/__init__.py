"""The reshard test suite (a package, so that every module is `tests.<folder>.<name>` and helpers are
`tests.support.X`; see tests/conftest.py for the tiers)."""
