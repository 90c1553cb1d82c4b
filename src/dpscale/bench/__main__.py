"""`python -m dpscale.bench`: the benchmarks' command line (``dpscale.bench.main``)."""

import sys

from dpscale.bench import main

sys.exit(main())
