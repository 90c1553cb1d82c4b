"""`python -m dpscale`: the command line (``dpscale.cli.main``)."""

import sys

from dpscale.cli import main

sys.exit(main())
