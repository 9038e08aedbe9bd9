"""A benchmark-only task whose reward is a fair coin, and the reference worker that scores with it.

    python -m bench.coin_task <the reference worker's arguments>

Not a task to train: on random weights every real reward is 0, so no weight moves and every patch is
empty. A coin per sample (one bit of a hash of its completion) gives Adam a gradient, so the throughput
benchmark (bench/gpu_loop.py) publishes patches of a real step's size. The task is registered only in this
process, never in `worker_contract.tasks`.
More in docs/performance.md (module notes).
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
    """Make the task known in this process only (the reference worker samples every registered task)."""
    from worker_contract.tasks import register_task

    register_task(CoinTask)


def main(argv: list[str] | None = None) -> int:
    """The reference worker (`python -m worker_contract.worker`) with the task registered."""
    register()
    from worker_contract.worker.__main__ import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m bench.coin_task"))
