"""What every Invoke task shares: one way to fail, strict flag values, and a confirmation before damage.

`stoa_task` is `invoke.task` with the house rules applied: no positional arguments and no automatic short
flags (a short flag would mean different things in different tasks: `-v` was `--reveal` in one of them),
bad input ends in one sentence and exit 2, a closed pipe is quiet, our own bug says so (worker_contract.cli).
Flag values that are numbers arrive as strings (a default of None), so `--lines abc` is our sentence, not
invoke's cast traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

from invoke import Exit, task

from worker_contract.cli import (
    EXIT_BAD_INPUT,
    UsageError,
    one_sentence,
    quiet_broken_pipe,
    report_bug,
    user_errors,
)

#: the checkout the tasks run in (tasks.py sits at its top)
REPO_ROOT = Path(__file__).resolve().parent.parent


def stoa_task(*args, **kwargs) -> Callable:
    """`@stoa_task(help={...})`: an Invoke task whose body's errors end as the house rules say."""
    kwargs.setdefault("positional", [])
    kwargs.setdefault("auto_shortflags", False)

    def decorate(body: Callable) -> Callable:
        name = body.__name__.rstrip("_")

        @functools.wraps(body)
        def guarded(c, *a, **kw):
            try:
                try:
                    return body(c, *a, **kw)
                finally:
                    sys.stdout.flush()  # a closed pipe shows here when the output fit in the buffer
            except Exit:
                raise
            except BrokenPipeError:
                raise Exit(code=quiet_broken_pipe()) from None
            except KeyboardInterrupt:
                raise Exit(f"{name}: interrupted", code=130) from None
            except Exception as e:
                if isinstance(e, user_errors()):
                    raise Exit(f"{name}: {one_sentence(e)}", code=EXIT_BAD_INPUT) from None
                raise Exit(code=report_bug(f"invoke {name}")) from None

        return task(*args, **kwargs)(guarded)

    return decorate


def int_flag(flag: str, value: object, default: int, minimum: int | None = None) -> int:
    """A flag's integer value (`--lines 50`); None -> `default`; anything else is refused by name."""
    from worker_contract.env import env_int

    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise UsageError(f"{flag} needs a value (for example {flag} {default})")
    return env_int(flag, str(value), minimum, example=default)


def need_run(run: str | None, what: str = "the run id (DRL_RUN)") -> str:
    """--run, else DRL_RUN from the environment; checked as a run id."""
    import os

    from worker_contract.layout import check_run_id

    run = run or os.environ.get("DRL_RUN", "").strip() or None
    if not run:
        raise UsageError(f"--run is required: {what}")
    return check_run_id(run)


def confirm(actions: list[str], *, yes: bool, question: str = "Go ahead?") -> None:
    """Name everything that will be touched, then ask on a terminal; `--yes` is the answer for scripts.
    Not on a terminal and no --yes: refuse (nothing destructive happens by surprise)."""
    for a in actions:
        print(f"  will {a}")
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError("not a terminal, so nothing was asked and nothing was changed: rerun with --yes "
                         "to confirm (or --dry-run to only list it)")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise Exit("nothing was changed", code=1)
