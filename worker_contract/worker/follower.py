"""Following the pointer beside sampling: a background thread reads, checks and applies each new patch while
the worker samples a group on the version it holds, so that between groups a new version costs only the
model's rewrite of what changed. While the thread runs, `take()` does not wait for the store or a follow in
flight: a patch still being applied lands at the next group (a group may start behind the pointer by what
the thread has not applied; the learner's staleness bound covers that). A worker with nothing left to sample
on its version (its per-version cap: `take(wait=True)`), or one without the thread, follows at once. It gets
the union of the positions every patch on the way changed, or None (rewrite everything) past an anchor, and
what `prepare` (the policy's `prepare_patch`) made of them: the values to write, read out of the plane on
the thread too, so that the pause is only the writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..reconstruct import Reconstructor, SyncError, merge_changes
from ..store import StoreError

log = logging.getLogger(__name__)


class Update(NamedTuple):
    version: int
    state: dict[str, Any]
    changes: dict[str, np.ndarray] | None  # positions changed since the last take; None: everything
    prepared: Any = None  # what `prepare` made of `changes` (None: nothing prepared)


class Follower:
    def __init__(self, rec: Reconstructor, *, interval_s: float, behind: int = 0,
                 prepare: Callable[[Mapping[str, Any], Mapping[str, np.ndarray]], Any] | None = None):
        self.rec, self.behind, self.interval_s, self.prepare = rec, behind, interval_s, prepare
        self._following = threading.Lock()  # one follow at a time: the thread's or take()'s
        self._handing = threading.Lock()  # what is ready: held only to merge or to hand over, never to follow
        self._ready: Update | None = None  # since the last take
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

    def take(self, wait: bool = False) -> Update | None:
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
            out, self._ready, self._changes = self._ready, None, {}
            return out

    def _follow(self) -> None:
        """Follow, then prepare the union of the changes; the version is handed over only once prepared. A
        take() while this prepares hands over the versions before it, so the union here may hold positions
        already written: writing them again with the newest values is harmless."""
        if self.rec.follow(self.behind) is None:
            return
        version, state, step = self.rec.version, self.rec.state, self.rec.changes
        with self._handing:
            changes = None if step is None or self._changes is None else dict(self._changes)
        if changes is not None:
            merge_changes(changes, step, state)
        prepared = None
        if self.prepare is not None and changes is not None:
            try:
                prepared = self.prepare(state, changes)
            except Exception:  # the reconstructor has moved on: the version must still be handed over
                log.exception("preparing v%d's writes failed; the worker will work them out between groups", version)
        with self._handing:
            self._ready, self._changes = Update(version, state, changes, prepared), changes

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
