"""`python -m reshard.cli ...`: the same as the `reshard` console script."""

import sys

from reshard.cli import main

sys.exit(main())
