"""Progress bars for long steps (conversion, downloads, anchor uploads, cold join, listing, gc).

One small helper so every long step looks the same and none of them clutters logs or pipes: bars go to
stderr, and only when stderr is a terminal (or `DRL_PROGRESS=1` forces them); `DRL_PROGRESS=0` turns them
off. Callers get a plain `advance(n)` callable either way, so the code path is identical with and without
a terminal. rich draws the bars (it handles terminals, refresh rate and transfer-speed columns). A long
step (a model build) asks for `lines_every_s`: where no bar is drawn it prints a line with its count, rate
and time left to stderr that often, so a log or a pipe shows it moving.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    """Whether bars are drawn: DRL_PROGRESS=1/0 forces it, else only on an interactive stderr."""
    forced = os.environ.get("DRL_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def _columns(unit: str):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    cols = [TextColumn("[bold]{task.description}"), BarColumn()]
    if unit == "bytes":
        cols += [DownloadColumn(), TransferSpeedColumn()]
    else:
        cols += [MofNCompleteColumn()]
    return [*cols, TimeElapsedColumn(), TimeRemainingColumn()]


@contextlib.contextmanager
def _bar(description: str, total: float | None, unit: str, show: bool):
    """(rich Progress, task id) of one bar on stderr, or None where nothing is drawn."""
    if unit not in ("items", "bytes"):
        raise ValueError(f"unit={unit!r}: use 'items' or 'bytes'")
    if not show or not enabled():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(*_columns(unit), console=Console(stderr=True), transient=False) as bar:
        yield bar, bar.add_task(description, total=total)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class _Lines:
    """`advance(n)` off a terminal: a line to stderr at the start, every `every_s` and at the end."""

    def __init__(self, description: str, total: float | None, unit: str, every_s: float):
        self.description, self.total, self.unit, self.every_s = description, total, unit, every_s
        self.clock = lambda: time.monotonic()
        self.done, self.start = 0.0, self.clock()
        self.last = self.start
        self._print("starting")

    def _print(self, note: str) -> None:
        print(f"{self.description}: {note}", file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = self.clock() - self.start
        count = f"{self.done:g}" + (f"/{self.total:g} ({100 * self.done / self.total:.0f}%)" if self.total else "")
        if self.unit == "bytes":
            count = f"{self.done / 1e6:.1f}" + (f"/{self.total / 1e6:.1f}" if self.total else "") + " MB"
        text = f"{count}, {_duration(elapsed)} elapsed"
        if self.total and self.done and self.done < self.total:
            text += f", about {_duration(elapsed / self.done * (self.total - self.done))} left"
        return text

    def __call__(self, n: float = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every_s and not (self.total and self.done >= self.total):
            self.last = now
            self._print(self.line())

    def finish(self) -> None:
        self._print(f"done, {self.line()}")


@contextlib.contextmanager
def progress(description: str, total: float | None = None, unit: str = "items", *,
             show: bool = True, lines_every_s: float | None = None) -> Iterator[Callable[[float], None]]:
    """Context manager yielding `advance(n)`; `unit="bytes"` shows sizes and speed.

    `total=None` draws an indeterminate bar (for listings whose length is unknown up front);
    `show=False` draws nothing whatever the terminal (a caller that runs in the background);
    `lines_every_s`: where no bar is drawn, progress lines with the time left (`_Lines`) instead.
    """
    with _bar(description, total, unit, show) as drawn:
        if drawn is None and lines_every_s is not None and show:
            lines = _Lines(description, total, unit, lines_every_s)
            yield lines
            lines.finish()
        elif drawn is None:
            yield lambda n=1: None
        else:
            bar, task = drawn
            yield lambda n=1: bar.advance(task, n)


@contextlib.contextmanager
def stage(description: str, *, show: bool = True) -> Iterator[None]:
    """A bar for one stage of unknown length (building a model, saving a checkpoint): indeterminate while
    the block runs, full once it ends without an error."""
    with _bar(description, None, "items", show) as drawn:
        yield
        if drawn is not None:
            bar, task = drawn
            bar.update(task, total=1, completed=1)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate `items` with a bar (a drop-in for a plain loop)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress(description, total=total) as advance:
        for item in items:
            yield item
            advance(1)

