"""python -m inference.bench: the benchmark's command line (inference/bench/cli.py)."""

import sys

from inference.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
