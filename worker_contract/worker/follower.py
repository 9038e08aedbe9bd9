"""Following the pointer beside sampling: a background thread reads, checks and applies each new patch while
the worker samples a group on the version it holds, so that between groups a new version costs only the
model's rewrite of what changed.

`take()` (between groups) still follows up to the pointer as it is then, waiting for a follow in flight: the
worker reaches the version it would without the thread, which only does that work earlier. It hands over
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
    def __init__(self, rec: Reconstructor, *, behind: int = 0, interval_s: float = 2.0):
        self.rec, self.behind, self.interval_s = rec, behind, interval_s
        self._lock = threading.Lock()  # one follow at a time: the thread's or take()'s
        self._moved = False
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

    def take(self) -> tuple[int, dict[str, Any], dict[str, np.ndarray] | None] | None:
        """What moved since the last take, followed up to the pointer now; None if nothing did. A follow that
        fails (a forged or damaged object, a flaky store) is logged, and what the thread already moved
        through and checked is still handed over."""
        with self._lock:
            try:
                self._follow()
            except (SyncError, StoreError) as e:
                log.warning("not following the pointer, staying on v%d: %s", self.rec.version, e)
            if not self._moved:
                return None
            out = (self.rec.version, self.rec.state, self._changes)
            self._moved, self._changes = False, {}
            return out

    def _follow(self) -> None:
        if self.rec.follow(self.behind) is None:
            return
        self._moved = True
        step = self.rec.changes
        if step is None or self._changes is None:
            self._changes = None
        else:
            merge_changes(self._changes, step, self.rec.state)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self._lock:
                    self._follow()
                self._said = None
            except (SyncError, StoreError) as e:
                if str(e) != self._said:  # take() says it again at the next group, where it matters
                    log.info("the pointer moved but did not follow yet: %s", e)
                self._said = str(e)
            except Exception:  # a bug here must not end the thread silently; take() follows on its own
                log.exception("following the pointer in the background failed")
                self._said = None
