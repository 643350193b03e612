"""`python -m quire` runs the command line."""

import sys

from quire.cli import main

sys.exit(main())
