"""A launch is a list of named steps run in order; each reports its result, the first failure stops it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping


class StepFailed(RuntimeError):
    """A launch step failed; the message names the step and carries its error output."""


def run_steps(steps: list[tuple[str, Callable[[], str]]], out: Callable[[str], None],
              catch: tuple[type[BaseException], ...] = (), err: Callable[[str], None] | None = None) -> int:
    """Run `steps` in order, printing `[i/n] name: result`; on the first failure print its error (to `err`,
    default `out`: the box entry sends it to stderr, which the SSH side reports), return 1."""
    from worker_contract.env import redact

    for i, (name, fn) in enumerate(steps, 1):
        out(f"[{i}/{len(steps)}] {name} ...")
        try:
            result = fn()
        except (StepFailed, ValueError, OSError, *catch) as e:
            (err or out)(f"[{i}/{len(steps)}] {name} FAILED: {type(e).__name__}\n{redact(str(e))}")
            return 1
        out(f"[{i}/{len(steps)}] {name}: {result}")
    return 0


def run_command(step: str, argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """Run one command of a step; its stdout, or StepFailed naming the step with the command's error tail."""
    res = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ if env is None else env),
                         check=False)
    if res.returncode != 0:
        raise StepFailed(f"{step}: `{' '.join(argv[:4])} ...` exited {res.returncode}:\n"
                         f"{(res.stderr or res.stdout).strip()[-3000:]}")
    return res.stdout
