"""Publishing off the learner's critical path: a background thread publishes each new state while the
next step runs.

The step hands over a snapshot (its own copy of the weights in the run's dtype, `Backend.publish_snapshot`:
on a GPU a device copy) and goes on; the thread makes the plane, encodes, hashes, uploads and moves the
pointer (trainer/publish/publisher.py, whose order keeps docs/reliability.md: every object create-only and read back,
the pointer last, versions never reused), then writes the version's stats object. On CUDA the thread works
on its own stream, which first waits for the snapshot's copy, so its kernels overlap the next step's.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .publisher import Publisher

log = logging.getLogger(__name__)


@dataclass
class Published:
    """One finished publish."""

    step: int
    """The learner step whose weights it holds."""
    version: int | None
    """The version it became visible as (None: it failed)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """The publish/* values (kind, bytes, latency_s, ...)."""
    error: str | None = None


@dataclass
class _Item:
    state: Mapping[str, Any]
    step: int
    report: Any
    """Handed to `on_published` with the result (the step's metrics and counts, for the stats object)."""
    ready: Any = None
    """A CUDA event the snapshot's copy recorded (None for host tensors)."""
    queued_at: float = 0.0


def _cuda_device(state: Mapping[str, Any]):
    for t in state.values():
        if getattr(t, "is_cuda", False):
            return t.device
    return None


class PublishQueue:
    """Publishes handed-over states in order on one thread; the newest waiting state wins."""

    def __init__(self, publisher: Publisher, on_published: Callable[[Published, Any], None] | None = None):
        self.publisher = publisher
        self.on_published = on_published
        self.skipped_states = 0
        """States replaced by a newer one before they were published."""
        self.failures = 0
        self.current: int | None = None
        """The newest version this queue made visible."""
        self.last: Published | None = None
        self._pending: _Item | None = None
        self._busy = False
        self._done: list[Published] = []
        self._cond = threading.Condition()
        self._publishing = threading.Lock()  # one publish at a time: the thread's, or publish_now's
        self._closed = False
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    # -- the learner's side ----------------------------------------------------------------------------
    def submit(self, state: Mapping[str, Any], step: int, report: Any = None) -> float:
        """Hand over a snapshot the caller will not touch again; returns the seconds this call blocked."""
        t0 = time.monotonic()
        ready = None
        device = _cuda_device(state)
        if device is not None:
            import torch

            ready = torch.cuda.current_stream(device).record_event()
        item = _Item(state, step, report, ready, queued_at=t0)
        with self._cond:
            if self._closed:
                raise RuntimeError("the publish queue is closed")
            if self._pending is not None:
                self.skipped_states += 1
                item.report = _merge_reports(self._pending.report, report)
                log.info("publishing is behind: the weights of step %d replace those of step %d, still waiting",
                         step, self._pending.step)
            self._pending = item
            self._cond.notify_all()
        return time.monotonic() - t0

    def publish_now(self, state: Mapping[str, Any], step: int, report: Any = None, *, anchor: bool = False
                    ) -> Published:
        """Publish in the caller's thread once the queue is idle (the start's anchor); raises on failure."""
        self.flush()
        with self._publishing:
            result = self._publish(state, step, anchor=anchor)
        self._finish(result, report)
        return result

    def collect(self) -> list[Published]:
        """The publishes finished since the last call, oldest first."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def idle(self) -> bool:
        """Nothing waiting, nothing being published."""
        with self._cond:
            return self._pending is None and not self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every handed-over state is published (or failed); False if `timeout_s` ran out."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Publish what is queued, then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                item, self._pending = self._pending, None
                self._busy = True
            try:
                with self._publishing:
                    result = self._publish(item.state, item.step, ready=item.ready)
            except Exception as e:  # a failed publish delays workers; it does not stop learning
                self.failures += 1
                log.error("publishing the weights of step %d failed: %s", item.step, e)
                result = Published(item.step, None, error=str(e))
            result.stats.setdefault("queue_wait_s", time.monotonic() - item.queued_at - result.stats.get(
                "latency_s", 0.0))
            del item.state  # the snapshot's memory goes back before the next one is taken
            try:
                self._finish(result, item.report)
            except Exception:  # the stats object is advisory; the version is published
                log.exception("reporting the publish of step %d failed", item.step)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _publish(self, state: Mapping[str, Any], step: int, *, anchor: bool = False, ready=None) -> Published:
        device = _cuda_device(state)
        if device is None:
            done = self.publisher.publish_anchor(state) if anchor else self.publisher.publish(state)
        else:  # on the thread's own stream, after the snapshot's copy, so the next step's kernels overlap
            import torch

            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                done = self.publisher.publish_anchor(state) if anchor else self.publisher.publish(state)
            self._stream.synchronize()  # done with the snapshot before its memory can be reused
        stats = {k: v for k, v in done.stats.items() if isinstance(v, int | float | str | bool)}
        stats.setdefault("patch_bytes", stats.get("bytes"))
        stats["kind"] = str(done.kind)
        return Published(step, done.version, stats)

    def _finish(self, result: Published, report: Any) -> None:
        with self._cond:
            if result.version is not None:
                self.current = max(self.current or 0, result.version)
                self.last = result
            self._done.append(result)
        if self.on_published is not None and result.version is not None:
            self.on_published(result, report)


def _merge_reports(older: Any, newer: Any) -> Any:
    """A replaced state's report folded into the one that replaces it (objects with `absorb`)."""
    if newer is not None and hasattr(newer, "absorb"):
        newer.absorb(older)
    return newer
