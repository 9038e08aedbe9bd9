"""What the embedded run shows: a live panel while it trains, a summary table when it ends.

The state comes from the run's metrics.jsonl (the learner's step rows and the held-out rows), read as it
grows, so the view shows exactly what the file records. On a terminal the panel redraws in place (rich);
elsewhere (CI, a pipe) a plain line is printed every few steps instead.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@contextlib.contextmanager
def transformers_errors_only():
    """transformers says only its errors meanwhile: its once-per-process notes ("causal_conv1d falls back to
    PyTorch", printed at the first forward of the base's build or of the first held-out evaluation) would tear
    the panel, and a user cannot act on them."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class MetricsTail:
    """New complete lines of a JSONL file since the last read (a half-written last line waits)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows


@dataclass
class RunState:
    run: str
    max_steps: int
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    step: int = 0
    session_first_step: int | None = None
    version: int | None = None
    rewards: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int | None, int, float]] = field(default_factory=list)
    accepted: float = 0.0
    drops: dict[str, float] = field(default_factory=dict)
    workers: dict[str, float] = field(default_factory=dict)
    phase: str = "starting the learner and workers"
    heldout_label: str = "held-out accuracy"
    """The task's name for its held-out score (`Task.heldout_label`)."""
    recipe: str = ""
    """The recipe this run was made from: the resume line names its make target."""
    alert: str | None = None
    """The learner's newest failure line this session (a full store, a publish that failed): shown on the
    panel, not only in learner.log."""
    search: dict[str, float] = field(default_factory=dict)
    """psqa: the latest train-side (rollout/*) and held-out (eval/*) search rate and share of correct answers
    found after a search."""

    def update(self, row: dict) -> bool:
        """Fold one metrics row in; True if it was a learner step row."""
        self.search.update({k: float(row[k]) for k in SEARCH_KEYS if row.get(k) is not None})
        if "eval/accuracy" in row:
            self.evals.append((row.get("step"), int(row.get("eval/version") or 0), float(row["eval/accuracy"])))
            return False
        if "step" not in row or "rollout/raw_reward" not in row:
            return False
        self.step = int(row["step"])
        if self.session_first_step is None:
            self.session_first_step = self.step
        self.version = row.get("version", self.version)
        if row.get("rollout/raw_reward") is not None:
            self.rewards.append((self.step, float(row["rollout/raw_reward"])))
        self.accepted = float(row.get("rollout/accepted") or self.accepted)
        self.drops = {k.rsplit("/", 1)[1]: v for k, v in row.items()
                      if k.startswith("rollout/drops/") and v}
        self.workers = {k.split("/")[1]: v for k, v in row.items()
                        if k.startswith("worker/") and k.endswith("/groups") and v is not None}
        self.phase = "training"
        return True

    def new_session(self) -> None:
        """From here on rows come from a new learner process, whose counts of groups and drops start at 0 (a
        resume reads the bucket again): the panel shows this session's, never an earlier session's beside them."""
        self.session_first_step, self.accepted, self.drops, self.workers = None, 0.0, {}, {}

    def recent_reward(self, n: int = 5) -> float | None:
        tail = [r for _, r in self.rewards[-n:]]
        return sum(tail) / len(tail) if tail else None

    def heldout(self) -> tuple[float | None, float | None]:
        """(first, latest) held-out accuracy: the first is the base's in a fresh run."""
        first, last = self.heldout_points()
        return (first[2] if first else None), (last[2] if last else None)

    def heldout_points(self) -> tuple[tuple | None, tuple | None]:
        """The first and the latest held-out evaluation, each (step, version, accuracy)."""
        if not self.evals:
            return None, None
        ordered = sorted(self.evals, key=lambda e: (e[0] if e[0] is not None else -1, e[1]))
        return ordered[0], ordered[-1]


SEARCH_KEYS = ("rollout/search_rate", "rollout/correct_after_search", "eval/search_rate",
               "eval/correct_after_search")


def _search_rows(state: RunState) -> list[tuple[str, str]]:
    """psqa: (label, value) rows for the search rate and the correct answers found after a search."""
    if not state.search:
        return []
    g = state.search.get
    return [("search rate", f"held-out {_pct(g('eval/search_rate'))}, train {_pct(g('rollout/search_rate'))} "
             "(episodes with at least one search)"),
            ("correct after a search", f"held-out {_pct(g('eval/correct_after_search'))}, train "
             f"{_pct(g('rollout/correct_after_search'))} (of the correct answers)")]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _points(base: float, last: float) -> float:
    """The change between two shares as printed (`_pct`'s one decimal): 24.8% -> 54.0% is +29.2, never the
    unrounded +29.25 printed as +29.3."""
    return round(100 * last, 1) - round(100 * base, 1)


def _drops(state: RunState) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(state.drops.items())) or "none"


#: what a learner log line says when something the run needs failed (the learner logs without levels)
_FAILURE = re.compile(r"failed|error|no space left|quota|traceback", re.IGNORECASE)


def learner_alert(log_tail: str) -> str | None:
    """The newest line of the learner's log tail that says something failed (its time stamp cut), or None."""
    for line in reversed(log_tail.splitlines()):
        if _FAILURE.search(line):
            return re.sub(r"^\d\d:\d\d:\d\d \S+ ", "", line.strip())[:200]
    return None


def panel(state: RunState):
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    elapsed = time.monotonic() - state.started
    base, last = state.heldout()
    t.add_row("phase", state.phase)
    t.add_row("step", f"{state.step} / {state.max_steps}   ({elapsed:.0f} s of {state.budget_s:.0f} s)")
    t.add_row("train reward", f"{_pct(state.recent_reward())} (mean of the last 5 steps)")
    delta = f", {_points(base, last):+.1f} points" if base is not None and last is not None else ""
    t.add_row(_acc_label(state), f"{_pct(last)}   (base {_pct(base)}{delta}; {len(state.evals)} evals)")
    for label, value in _search_rows(state):
        t.add_row(label, value)
    t.add_row("version", f"v{state.version}" if state.version else "-")
    t.add_row("groups received", f"{int(state.accepted)} this session   by worker: " +
              (", ".join(f"{w} {int(g)}" for w, g in sorted(state.workers.items())) or "-"))
    t.add_row("drops", f"{_drops(state)} (this session)")
    if state.alert:
        t.add_row("[red]learner[/]", f"[red]{escape(state.alert)}[/] (more in learner.log)")
    return Panel(t, title=f"stoa embedded run [bold]{state.run}[/]", border_style="cyan")


def _acc_label(state: RunState) -> str:
    return state.heldout_label


def status_line(state: RunState) -> str:
    base, last = state.heldout()
    search = (f"  search {_pct(state.search.get('eval/search_rate'))} held-out / "
              f"{_pct(state.search.get('rollout/search_rate'))} train" if state.search else "")
    return (f"step {state.step}/{state.max_steps}  reward {_pct(state.recent_reward())}  held-out {_pct(last)} "
            f"(base {_pct(base)}){search}  v{state.version}  groups {int(state.accepted)}  drops {_drops(state)}")


def summary(console, state: RunState, *, paths, plots: list[Path], stop_reason: str, store_url: str) -> None:
    from rich.table import Table

    base, last = state.heldout()
    t = Table(title=f"run {state.run}: {stop_reason}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    first = state.session_first_step
    t.add_row("steps", f"{state.step} in total" + (f" ({state.step - first + 1} this session)" if first else ""))
    t.add_row("versions", f"v{state.version} published (the pointer)" if state.version else "none published")
    r0 = [r for _, r in state.rewards[:5]]
    t.add_row("train reward", f"{_pct(sum(r0) / len(r0) if r0 else None)} -> {_pct(state.recent_reward())} "
              "(first 5 steps -> last 5)")
    delta = f" ({_points(base, last):+.1f} points)" if base is not None and last is not None else ""
    e0, e1 = state.heldout_points()
    # the versions scored: the last is the final evaluation's, run after the panel's last frame
    scored = f"; v{e0[1]} -> v{e1[1]}" if e0 and e1 else ""
    t.add_row(_acc_label(state), f"{_pct(base)} -> {_pct(last)}{delta}{scored}")
    for label, value in _search_rows(state):
        t.add_row(label, value)
    t.add_row("groups received", f"{int(state.accepted)} this session (accepted into the learner's pool)")
    t.add_row("drops", f"{_drops(state)} (this session)")
    t.add_row("wall time", f"{time.monotonic() - state.started:.0f} s")
    console.print(t)
    # what a user copies goes below the table, a line each: a table cell cuts a long path to the terminal's width
    copied = [("metrics", str(paths.metrics)), *(("plot", str(p)) for p in plots),
              ("logs", str(paths.run_dir / "learner.log") + ", worker-*.log"),
              # the venv's Python by its path: a bare `python` outside the activated venv lacks the project's packages
              ("check", f"{shlex.quote(sys.executable)} -m worker_contract verify --store {shlex.quote(store_url)} "
                        f"--run {state.run}"),
              ("resume", f"make {state.recipe} RUN={state.run}")]
    for label, value in copied:
        console.print(f"{label + ':':<9}{value}", soft_wrap=True, markup=False, highlight=False)
