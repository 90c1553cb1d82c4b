import sys

from dpscale.bench import main

sys.exit(main())
