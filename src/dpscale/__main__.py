import sys

from dpscale.cli import main

sys.exit(main())
