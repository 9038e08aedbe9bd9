"""`trainer.psqa_eval` is trainer/embedded/psqa_eval.py, under the name earlier releases and users' scripts
use; `python -m trainer.psqa_eval` (the old command) re-executes `python -m entrypoints.psqa_eval`."""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "entrypoints.psqa_eval", *sys.argv[1:]])
else:
    from .embedded import psqa_eval

    sys.modules[__name__] = psqa_eval
