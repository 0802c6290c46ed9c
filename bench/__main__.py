"""`python -m bench`: the suite (bench/run.py), `python -m bench list`, `python -m bench NAME [ARGS]` (bench/commands.py)."""

import sys

from bench.commands import dispatch

sys.exit(dispatch(sys.argv[1:]))
