"""A benchmark-only task whose reward is a fair coin, and the reference worker that scores with it.

    python -m bench.coin_task <the reference worker's arguments>

Not a task to train: its reward says nothing about the answer. It exists so that a throughput benchmark on
random weights (bench/gpu_loop.py) moves the weights as a real run would. On random weights every answer
of a real task is wrong, every reward 0, every Dr.GRPO advantage 0: the gradient is zero, no weight moves
and every patch is empty. Here each sample's reward is one bit of a hash of its completion, so within a
group of 8 the rewards differ (all equal in about 2 of 256 groups), the advantages are not zero, and Adam, whose
step is normalised by the gradient's own scale, moves the weights by about the learning rate however
meaningless the signal: the patches then carry changed bf16 positions as a real step's do.

The prompts, data and answer extraction are the generated arithmetic task's; only `reward` differs. The
name carries the `bench-` prefix, and the task is registered only in the process of `main` below (the
reference worker run by the benchmark), never in `worker_contract.tasks`: a user's worker, trainer or
recipe does not know it (the plain reference worker refuses a run that names it, exit 3).

The hash is BLAKE2b of the completion's text (what a task's scorer is given: `Task.reward` gets the
decoded text, not the token ids), its first bit. On the benchmark's random 1.5B model the decoded text is
short (ids outside the small tokenizer's 512 decode to nothing): of 1024 ids drawn uniformly, about 6% of
completions decode to the empty text and share one bit, which leaves a group's rewards unequal all the same.
"""

from __future__ import annotations

import hashlib
import sys

from worker_contract.tasks.arithmetic import ArithmeticTask
from worker_contract.tasks.base import Problem

NAME = "bench-coin"


class CoinTask(ArithmeticTask):
    """The arithmetic task's prompts with a coin-flip reward: 1.0 or 0.0 from a hash of the completion."""

    name = NAME

    def reward(self, completion: str, problem: Problem) -> float:
        return float(hashlib.blake2b(completion.encode("utf-8", "surrogatepass")).digest()[0] & 1)


def register() -> None:
    """Make the task known in this process only: to the task registry and to the reference worker's list of
    single-turn tasks it samples."""
    from worker_contract.tasks import TASKS
    from worker_contract.worker import loop

    TASKS[NAME] = CoinTask
    loop.SINGLE_TURN_TASKS = loop.SINGLE_TURN_TASKS | {NAME}


def main(argv: list[str] | None = None) -> int:
    """The reference worker (`python -m worker_contract.worker`) with the task registered."""
    register()
    from worker_contract.worker.__main__ import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m bench.coin_task"))
