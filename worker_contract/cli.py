"""How every command-line entry point ends: bad input is one sentence and exit 2, a closed pipe is quiet,
our own bug is a traceback that says it is one and where to report it.

    sys.exit(run_main(main, prog="python -m infra.preflight"))

Exit statuses, the same for every `python -m` CLI, Invoke task, make target and nox session's command:
0 done, 1 a check failed (preflight, verify, box check), 2 bad input (the sentence says what to fix),
70 a bug in stoa trainer (EX_SOFTWARE), 130 interrupted, 141 the reader of the output went away (SIGPIPE).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_BUG = 70
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
#: where a bug report goes (the project has no public tracker URL; the lead's repository is it)
REPORT_TO = "the stoa trainer repository's issue tracker (include this output and `git rev-parse HEAD`)"


class UsageError(ValueError):
    """Bad input a command found itself (a missing flag, an out-of-range value): the message is the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the input is wrong, not the code: ValueError (EnvError, pydantic's
    ValidationError, our own refusals), store failures (an unreachable or refusing bucket) and a path the
    user named that is missing or unreadable."""
    from .store import StoreError

    return (ValueError, StoreError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _validation_line(err) -> str:
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])  # our validator's own sentence, without pydantic's 'Value error, '
    got = "" if err["type"] == "missing" else f" (got {repr(err.get('input'))[:80]})"
    return f"{'.'.join(map(str, err['loc']))}: {err['msg']}{got}"


def one_sentence(e: BaseException) -> str:
    """The error's message on one line, secrets redacted (pydantic's multi-line text folded)."""
    from pydantic import ValidationError

    from .env import redact

    text = str(e) if not isinstance(e, KeyError) else str(e.args[0] if e.args else e)
    if isinstance(e, ValidationError):  # 'field: what is wrong (got x)', or our validator's own sentence
        text = "\n".join(_validation_line(err) for err in e.errors())
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.strip().startswith("For further information visit")]
    return redact("; ".join(lines) or type(e).__name__)


def quiet_broken_pipe() -> int:
    """The reader of our output closed it (`| head`): stop writing, no traceback (Python docs' recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


#: the project's own top-level packages: a missing one of these is our bug (or the wrong directory), not a
#: missing dependency
OUR_PACKAGES = frozenset({"worker_contract", "trainer", "infra", "entrypoints", "embedded", "bench", "tasks"})


def missing_dependency(e: ModuleNotFoundError) -> bool:
    """Whether the module that could not be imported is a third-party one (run outside the venv)."""
    return bool(e.name) and e.name.split(".")[0] not in OUR_PACKAGES


def report_bug(prog: str) -> int:
    """Print the traceback of the exception being handled as what it is: our bug."""
    from .env import redact

    print(redact(traceback.format_exc()).rstrip(), file=sys.stderr)
    print(f"{prog}: this is a bug in stoa trainer, not a problem with your input; please report it to "
          f"{REPORT_TO}", file=sys.stderr)
    return EXIT_BUG


def run_main(main: Callable[[], int | None], prog: str) -> int:
    """Call `main` and turn how it ended into the documented exit status."""
    try:
        code = int(main() or 0)
        sys.stdout.flush()  # a closed pipe shows here when the output fit in the buffer
        return code
    except BrokenPipeError:
        return quiet_broken_pipe()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and missing_dependency(e):  # before anything below imports one
            if sys.prefix == sys.base_prefix:  # no venv at all: the project's was not activated
                fix = ("run the command in the project's venv (`source .venv/bin/activate`, or `.venv/bin/python "
                       "-m ...`; `make setup` makes it), or install the project into this Python")
            else:  # a venv without it: an extra this command needs was not installed
                fix = (f"install it into this venv ({sys.prefix}): `make setup` installs what every command needs; "
                       "a worker-only install takes its backend's extra (pip install -e '.[mlx]' or '.[worker]')")
            print(f"{prog}: this Python ({sys.executable}) lacks {e.name!r}, which this command needs: {fix}",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        if isinstance(e, user_errors()):
            try:
                print(f"{prog}: {one_sentence(e)}", file=sys.stderr)
            except BrokenPipeError:
                return quiet_broken_pipe()
            return EXIT_BAD_INPUT
        return report_bug(prog)


def number(kind: type = int, *, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, hint: str = "") -> Callable[[str], float]:
    """The one check of a number a user types (an argparse `type=`): `kind` (int or float) parsed, finite, and
    within the bounds, else argparse's one-line error, exit 2, saying the range (`hint` adds what it means)."""
    import argparse
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number"
                                             + (f" ({hint})" if hint else ""))
        if ((at_least is not None and value < at_least) or (above is not None and value <= above)
                or (at_most is not None and value > at_most)):
            want = [b for b in (f"at least {at_least:g}" if at_least is not None else "",
                                f"above {above:g}" if above is not None else "",
                                f"at most {at_most:g}" if at_most is not None else "") if b]
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a number {' and '.join(want)}"
                                             + (f" ({hint})" if hint else ""))
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def output_dir(path: str | os.PathLike, flag: str = "--out"):
    """The one check of a directory a command will write into, before it works: not a file, and it or its
    nearest existing parent writable by this user (ValueError, one sentence, otherwise). Creates nothing (a
    dry run, or a command that finds nothing to write, leaves no trace); returns it as a Path."""
    from pathlib import Path

    if not str(path).strip():
        raise ValueError(f"{flag} {str(path)!r} names no directory: give the directory to write")
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a directory: name a directory to write into")
    there = next((p for p in (out, *out.absolute().parents) if p.exists()), Path("/"))
    try:  # a probe, not os.access: root passes access() on a read-only file system or /proc
        import tempfile

        with tempfile.TemporaryFile(dir=there, prefix=".stoa-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {out} cannot be written: {there} refuses new files ({e.strerror or e}); "
                         "choose a directory you can write") from None
    return out
