"""Progress bars for long steps (conversion, downloads, anchor uploads, cold join, listing, gc).

One small helper so every long step looks the same and none of them clutters logs or pipes: bars go to
stderr, and only when stderr is a terminal (or `DRL_PROGRESS=1` forces them); `DRL_PROGRESS=0` turns them
off. Callers get a plain `advance(n)` callable either way, so the code path is identical with and without
a terminal. rich draws the bars (it handles terminals, refresh rate and transfer-speed columns).
"""

from __future__ import annotations

import contextlib
import os
import sys
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


@contextlib.contextmanager
def progress(description: str, total: float | None = None, unit: str = "items", *,
             show: bool = True) -> Iterator[Callable[[float], None]]:
    """Context manager yielding `advance(n)`; `unit="bytes"` shows sizes and speed.

    `total=None` draws an indeterminate bar (for listings whose length is unknown up front);
    `show=False` draws nothing whatever the terminal (a caller that runs in the background).
    """
    with _bar(description, total, unit, show) as drawn:
        if drawn is None:
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

