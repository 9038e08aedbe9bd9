"""Compatibility shim: `python -m trainer.native ...` re-executes `python -m entrypoints.learner ...` with the
same arguments (the one learner process, which both launchers start: entrypoints/learner.py).

It imports nothing of ours, so `trainer` keeps importing only `worker_contract`; closed issues and users'
notes that name `trainer.native` keep working, with its Ray dashboard on 127.0.0.1 as before
(DRL_RAY_DASHBOARD=0 turns it off).
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DRL_RAY_DASHBOARD", "1")
    os.execv(sys.executable, [sys.executable, "-m", "entrypoints.learner", *sys.argv[1:]])
