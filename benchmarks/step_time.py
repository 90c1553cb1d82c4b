"""Step-time benchmark (see docs/benchmarks.md). Same as `dpscale bench step-time ...`:

    python benchmarks/step_time.py --models papernot-cnn,tramer-cifar-cnn --repeats 10 --write docs/benchmarks.md

Opacus rows need `pip install -c constraints.txt '.[bench]'`.
"""

import sys

from dpscale.bench import main

if __name__ == "__main__":
    sys.exit(main(["step-time", *sys.argv[1:]]))
