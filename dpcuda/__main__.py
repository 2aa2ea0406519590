"""python -m dpcuda: the command line (dpcuda/cli.py)."""

import sys

from .cli import main

sys.exit(main())
