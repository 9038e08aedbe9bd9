"""Entry point of `python -m bench.fleet`; see bench/fleet/cli.py."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
