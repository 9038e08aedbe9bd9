"""Tasks shared by worker and trainer: prompt format, data, answer extraction and reward.

One registry: `get_task(name)` returns the task a run's `run.json` names; an unknown name
is refused with the list of known ones. A worker scores its samples and the trainer scores its held-out
evaluation with the same `Task.reward`, so the two can never disagree on what "correct" means.

No torch here: an MLX worker imports this package as is.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import (
    SERVICES,
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


#: task name -> factory (a Task subclass or a function returning one). A task is its module: named after the task
#: in this package and calling `register_task`, it is found on first use (`is_task`, `get_task`); or anywhere,
#: imported before use (docs/extending.md).
TASKS: dict[str, Callable[[], Task]] = {
    "gsm8k": _gsm8k,
    "arithmetic": _arithmetic,
    "psqa": _psqa,
}


def register_task(cls: type[Task]) -> type[Task]:
    """Register a Task subclass under its `name` (usable as a class decorator); a name taken by another
    task is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Task)) or not getattr(cls, "name", ""):
        raise ValueError(f"register_task takes a Task subclass with a `name`; got {cls!r}")
    known = TASKS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"task name {cls.name!r} is taken; pick another `name` for {cls.__qualname__}")
    TASKS[cls.name] = cls
    return cls


def _discover(name: str) -> None:
    """Import this package's module named after the task (`my-task` -> `my_task.py`), whose `register_task`
    registers it: a task shipped here is its module alone, no line in `TASKS` needed."""
    import importlib
    import importlib.util
    import re

    if re.fullmatch(r"[a-z][a-z0-9_-]{0,63}", name):
        module = f"{__name__}.{name.replace('-', '_')}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def is_task(name: str) -> bool:
    """Whether a task of that name is registered (its module here imported on first use)."""
    if name not in TASKS:
        _discover(name)
    return name in TASKS


def get_task(name: str) -> Task:
    """The task registered under `name` (its module here imported on first use); a ValueError naming the known
    tasks otherwise."""
    if not is_task(name):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


__all__ = ["Problem", "Task", "CachedSplitTask", "LazySplit", "TASKS", "SERVICES", "SPLITS", "Split", "get_task",
           "register_task", "is_task", "check_split", "hf_datasets", "local_split_path"]
