"""Tasks shared by worker and trainer: prompt format, data, answer extraction and reward.

One registry: `get_task(name)` returns the task a run's `run.json` names; an unknown name
is refused with the list of known ones. A worker scores its samples and the trainer scores its held-out
evaluation with the same `Task.reward`, so the two can never disagree on what "correct" means.

No torch here: an MLX worker imports this package as is.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import (
    SPLITS,
    CachedSplitTask,
    LazySplit,
    Problem,
    Split,
    Task,
    check_split,
    hf_datasets,
    local_split_path,
)


def _gsm8k() -> Task:
    from .gsm8k import GSM8KTask

    return GSM8KTask()


def _arithmetic() -> Task:
    from .arithmetic import ArithmeticTask

    return ArithmeticTask()


def _psqa() -> Task:
    from .psqa import PsqaTask

    return PsqaTask()


#: task name -> factory. Add a task by writing its module and one line here.
TASKS: dict[str, Callable[[], Task]] = {
    "gsm8k": _gsm8k,
    "arithmetic": _arithmetic,
    "psqa": _psqa,
}

#: the registered tasks sampled as multi-turn tool episodes (a tool turn is a loss-mask-0 span); the others are
#: one prompt and one sampled turn per sample
MULTI_TURN_TASKS: frozenset[str] = frozenset({"psqa"})


def get_task(name: str) -> Task:
    """The task registered under `name`; a ValueError naming the known tasks otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


__all__ = ["Problem", "Task", "CachedSplitTask", "LazySplit", "TASKS", "MULTI_TURN_TASKS", "SPLITS", "Split", "get_task", "check_split",
           "hf_datasets", "local_split_path"]
