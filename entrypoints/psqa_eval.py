"""`python -m entrypoints.psqa_eval (--run ID --base DIR | --model DIR | --watch DIR) --out DIR [--retriever URL]
[...]`: held-out psqa.

The held-out PaperSearchQA curve (cover-EM pass@1, pass@k, search rate per version), run apart from the
learner on its own GPU or box; its work is trainer.psqa_eval.main.
"""

import sys

from trainer.psqa_eval import main
from worker_contract.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main(lambda: main(prog="python -m entrypoints.psqa_eval"), "python -m entrypoints.psqa_eval"))
