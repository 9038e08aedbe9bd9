"""Following the pointer beside sampling: a background thread reads, checks and applies each new patch while
the worker samples a group on the version it holds, so that between groups a new version costs only the
model's rewrite of what changed. While the thread runs, `take()` does not wait for the store or a follow in
flight: a patch still being applied lands at the next group (a group may start behind the pointer by what
the thread has not applied; the learner's staleness bound covers that). A worker with nothing left to sample
on its version (its per-version cap: `take(wait=True)`), or one without the thread, follows at once. It gets
the union of the positions every patch on the way changed, or None (rewrite everything) past an anchor.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from ..reconstruct import Reconstructor, SyncError, merge_changes
from ..store import StoreError

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, rec: Reconstructor, *, interval_s: float, behind: int = 0):
        self.rec, self.behind, self.interval_s = rec, behind, interval_s
        self._following = threading.Lock()  # one follow at a time: the thread's or take()'s
        self._handing = threading.Lock()  # what is ready: held only to merge or to hand over, never to follow
        self._ready: tuple[int, dict[str, Any]] | None = None  # (version, state) since the last take
        self._changes: dict[str, np.ndarray] | None = {}  # since the last take; None: everything
        self._said: str | None = None  # the last failure the thread logged (said once, not every poll)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pointer-follower", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def take(self, wait: bool = False) -> tuple[int, dict[str, Any], dict[str, np.ndarray] | None] | None:
        """What moved since the last take; None if nothing did. `wait` (a worker with nothing to sample on the
        version it holds) follows up to the pointer now, after any follow in flight. A follow that fails (a
        forged or damaged object, a flaky store) is logged, and what was already moved through and checked is
        still handed over."""
        if wait or self._thread is None or not self._thread.is_alive():
            with self._following:
                try:
                    self._follow()
                except (SyncError, StoreError) as e:
                    log.warning("not following the pointer, staying on v%d: %s", self.rec.version, e)
        with self._handing:
            if self._ready is None:
                return None
            out = (*self._ready, self._changes)
            self._ready, self._changes = None, {}
            return out

    def _follow(self) -> None:
        if self.rec.follow(self.behind) is None:
            return
        step = self.rec.changes
        with self._handing:
            self._ready = (self.rec.version, self.rec.state)
            if step is None or self._changes is None:
                self._changes = None
            else:
                merge_changes(self._changes, step, self.rec.state)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self._following:
                    self._follow()
                self._said = None
            except (SyncError, StoreError) as e:
                if str(e) != self._said:  # once a cause, not every poll
                    log.warning("not following the pointer, staying on v%d: %s", self.rec.version, e)
                self._said = str(e)
            except Exception:  # a bug here must not end the thread silently; the next poll tries again
                log.exception("following the pointer in the background failed")
                self._said = None
