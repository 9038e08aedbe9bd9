"""A launch is one list of steps (`Step`: what the plan prints and what runs) run in order; each reports its
result, the first failure stops it."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .launch_plan import LaunchStep


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


@dataclass(frozen=True)
class Step:
    """One launch step, written once: what the plan prints (`info`) and what runs (`run`, given the launch's
    context: infra/box_steps.py's BoxLaunch on the box, infra/remote's RemoteLaunch over SSH)."""

    info: LaunchStep
    run: Callable[[Any], str]


def plan_of(steps: list[Step]) -> list[LaunchStep]:
    """The steps as the launch plan lists them."""
    return [s.info for s in steps]


def bound(steps: list[Step], ctx: Any) -> list[tuple[str, Callable[[], str]]]:
    """The steps as `run_steps` runs them, each given `ctx`."""
    return [(s.info.name, functools.partial(s.run, ctx)) for s in steps]
