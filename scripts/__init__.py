"""The generators of docs tables and of the shipped plan table: `python scripts/NAME.py` or `scripts.NAME`."""
