"""Compatibility shim: `python -m trainer.launch ...` re-executes `python -m entrypoints.launch ...` with the
same arguments (the launcher is an entry point above `trainer` and `infra`: entrypoints/launch.py).

It imports nothing of ours, so `trainer` keeps importing only `worker_contract`; documented commands and
outside scripts that still name `trainer.launch` keep working.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "entrypoints.launch", *sys.argv[1:]])
