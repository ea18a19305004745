"""`python -m lightspeed.launcher`: the `lightspeed` command."""

import sys

from lightspeed.launcher.cli import main

sys.exit(main())
