"""`python -m sluice`: see sluice.cli."""

import sys

from sluice.cli import main

sys.exit(main())
