"""The bucket-backed rollout source: polls the store, reads every new record, hands it to the pool.

Workers write one immutable record per prompt group under `rollouts/v<version>/<worker>/<group>.json.zst`
(worker_contract/layout.py). The source lists only the version prefixes inside the staleness window, so
its listing cost is bounded by that window, never by the run's history; it reads new records several at
a time, judged in listing order, and counts groups that land below the window as `stale` drops.
trainer/rollouts/pool.py judges each record, pools the good ones, caps their reuse and counts drops.
Importable without torch or Ray (slime loads it by path). More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from worker_contract import layout
from worker_contract.schema import RecordError, decode_record
from worker_contract.store import NotFound, ObjectInfo, Store, StoreError
from worker_contract.tasks import get_task, is_task

from .pool import (
    DROP_REASONS,
    OTHER_WORKER,
    Batch,
    BatchRules,
    GroupPool,
    RecordRules,
    Tally,
)

if TYPE_CHECKING:
    from worker_contract.manifest import RunManifest

    from .pool import AlgoSection

log = logging.getLogger(__name__)
#: records read ahead of judging hold at most this many bytes (a single larger record is read alone)
READ_AHEAD_BYTES = 64 << 20



class RolloutSource:
    """Validated prompt groups from the bucket, `groups_per_step` at a time."""

    def __init__(self, store: Store, rules: RecordRules, batching: BatchRules, *, sweep_every: int = 10,
                 read_threads: int = 16, read_ahead: int | None = None, late_versions: int | None = None):
        read_ahead = 4 * read_threads if read_ahead is None else read_ahead
        for name, value in (("sweep_every", sweep_every), ("read_threads", read_threads),
                            ("read_ahead", read_ahead)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if late_versions is not None and late_versions < 0:
            raise ValueError(f"late_versions={late_versions} must be at least 0")
        self.store, self.rules, self.batching, self.sweep_every = store, rules, batching, sweep_every
        self.read_threads = read_threads
        #: records requested ahead of the one being judged (at most `read_threads` of them in flight at once)
        self.read_ahead = read_ahead
        #: versions a prefix stays watched for late uploads after it left the window (0: counted once, as it
        #: leaves)
        self.late_versions = 2 * (rules.staleness + 1) if late_versions is None else late_versions
        self._readers: ThreadPoolExecutor | None = None
        self.run = rules.run
        self.tally = Tally()
        self._pool = GroupPool(batching, rules.window, self.tally, rules.staleness,
                               get_task(rules.task) if rules.task is not None and is_task(rules.task) else None)
        self.list_calls = 0
        self._last_seen: dict[str, str] = {}  # prefix -> last key listed
        self._seen: dict[str, set[str]] = defaultdict(set)  # prefix -> keys handled
        self._listed: set[int] = set()  # versions listed in the window, to be retired when they leave it
        self._watched: set[int] = set()  # versions below the window still listed for late uploads
        self._polls = 0
        self._poll_lock = threading.Lock()  # one poll at a time (I/O happens outside the pool's lock)

    @classmethod
    def from_manifest(cls, store: Store, manifest: RunManifest, algo: AlgoSection, routes=None, **kw) -> RolloutSource:
        """A source that checks records against the run's published contract and the recipe (`routes`: the
        model's MoE route shape, worker_contract/routes.py; None for a dense model)."""
        return cls(store, RecordRules.from_manifest(manifest, algo, routes=routes),
                   BatchRules(groups_per_step=algo.groups_per_step, reuse_cap=algo.reuse_cap), **kw)

    @property
    def drops(self) -> Counter[str]:
        """Drops by reason, in total."""
        return self.tally.drops

    @property
    def accepted(self) -> int:
        return self.tally.accepted

    @property
    def current(self) -> int:
        """The newest version the learner has named (0 before it named one)."""
        return self._pool.current

    # -- listing -----------------------------------------------------------------------------------
    def window(self, current: int) -> range:
        """Policy versions a record may carry when the learner is at `current`."""
        return self.rules.window(current)

    def poll(self, current: int) -> int:
        """List the window's prefixes for new records, validate them, pool the good ones; returns how many."""
        with self._poll_lock:
            current = self._pool.advance(current)
            self._polls += 1
            sweep = self._polls % self.sweep_every == 0
            self._retire(current, sweep)
            added = 0
            for version in self.window(current):
                self._listed.add(version)
                prefix = layout.rollout_version_prefix(self.run, version)
                seen = self._seen[prefix]
                infos = [i for i in self._list(prefix, None if sweep else self._last_seen.get(prefix))
                         if i.key not in seen]
                for info, read in self._reads(infos):
                    added += self._ingest(info, prefix, current, read)
            return added

    def _list_counted(self, prefix: str, start_after: str | None = None) -> list[ObjectInfo]:
        """One listing, counted in `list_calls`; a StoreError propagates."""
        self.list_calls += 1
        return list(self.store.list(prefix, start_after=start_after))

    def _list(self, prefix: str, start_after: str | None) -> list[ObjectInfo]:
        try:
            infos = self._list_counted(prefix, start_after)
        except StoreError as e:  # a flaky store delays learning; it does not stop it
            log.warning("listing %s failed, will retry: %s", prefix, e)
            return []
        if infos:
            last = infos[-1].key
            self._last_seen[prefix] = max(last, self._last_seen.get(prefix, ""))
        return infos

    def _retire(self, current: int, sweep: bool) -> None:
        """Versions below the window (called under the poll lock). One that just left it is listed whole once
        more and its groups never read are counted as `stale`; it is then watched for `late_versions` more
        versions: listed whole on sweeps and once more as it leaves the watch, each new group counted as
        `stale` unread, before its listing state is forgotten. A listing that fails is retried at the next
        poll, so no version's count is skipped."""
        low = self.window(current).start
        listed_now: set[int] = set()
        for version in sorted(v for v in self._listed if v < low):
            if self._count_unread(version):
                self._listed.discard(version)
                self._last_seen.pop(layout.rollout_version_prefix(self.run, version), None)
                self._watched.add(version)
                listed_now.add(version)
        for version in sorted(self._watched):
            leaving = version < low - self.late_versions
            due = (leaving or sweep) and version not in listed_now
            if due and not self._count_unread(version):
                continue  # the listing failed: retried at the next poll
            if leaving:
                self._watched.discard(version)
                self._seen.pop(layout.rollout_version_prefix(self.run, version), None)

    def _count_unread(self, version: int) -> bool:
        """List a version below the window whole and count each group never handled as a `stale` drop
        (marked handled, never read); False if the listing failed."""
        prefix = layout.rollout_version_prefix(self.run, version)
        try:
            infos = self._list_counted(prefix)
        except StoreError as e:
            log.warning("listing %s (below the window) failed, will retry: %s", prefix, e)
            return False
        seen = self._seen[prefix]
        for info in infos:
            if info.key not in seen:
                seen.add(info.key)
                try:
                    self.tally.drop("stale", layout.parse_rollout_key(info.key).worker_id, info.key)
                except ValueError:
                    self.tally.drop("bad_key", OTHER_WORKER, info.key)
        return True

    # -- reading and judging -----------------------------------------------------------------------
    def _fetchable(self, info: ObjectInfo) -> bool:
        """Whether `_ingest` will read this record (a bad key or an oversized object is dropped unread)."""
        try:
            layout.parse_rollout_key(info.key)
        except ValueError:
            return False
        return info.size <= self.rules.max_record_bytes

    def _reads(self, infos: list[ObjectInfo]) -> Iterator[tuple[ObjectInfo, Callable[[], bytes]]]:
        """Each listed record, in listing order, with a call returning its bytes (raising as `store.get` does).
        With more than one read thread, reads run `read_threads` at once over a sliding window of at most
        `read_ahead` records and READ_AHEAD_BYTES (a single larger record is read alone) ahead of the record
        the caller is judging; a record dropped unread (bad key, oversized) is never requested."""
        if self.read_threads == 1:
            yield from ((info, partial(self.store.get, info.key)) for info in infos)
            return
        if self._readers is None:
            self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="rollout-read")
        ahead: deque[tuple[ObjectInfo, Future | None, int]] = deque()
        held = 0
        for info in infos:
            fetch = self._fetchable(info)
            n = info.size if fetch else 0
            while ahead and (len(ahead) >= self.read_ahead or held + n > READ_AHEAD_BYTES):
                done, future, size = ahead.popleft()
                held -= size
                yield done, future.result if future is not None else partial(self.store.get, done.key)
            ahead.append((info, self._readers.submit(self.store.get, info.key) if fetch else None, n))
            held += n
        while ahead:
            done, future, _ = ahead.popleft()
            yield done, future.result if future is not None else partial(self.store.get, done.key)

    def _ingest(self, info: ObjectInfo, prefix: str, current: int, read: Callable[[], bytes]) -> int:
        seen = self._seen[prefix]
        if info.key in seen:
            return 0
        try:
            parsed = layout.parse_rollout_key(info.key)
        except ValueError:
            seen.add(info.key)
            self.tally.drop("bad_key", OTHER_WORKER, info.key)
            return 0
        worker = parsed.worker_id
        if info.size > self.rules.max_record_bytes:
            seen.add(info.key)
            self.tally.drop("oversized", worker, info.key)
            return 0
        try:
            blob = read()
        except NotFound:
            seen.add(info.key)
            self.tally.drop("vanished", worker, info.key)
            return 0
        except StoreError as e:  # not marked seen: the next sweep retries it
            log.warning("reading %s failed, will retry: %s", info.key, e)
            return 0
        seen.add(info.key)
        try:
            record = decode_record(blob)
        except RecordError as e:
            self.tally.drop(e.reason if e.reason in DROP_REASONS else "malformed", worker, info.key)
            return 0
        reason = self.rules.check(record, parsed, current) or self._pool.admit(info.key, record, worker)
        if reason is not None:
            self.tally.drop(reason, worker, info.key)
            return 0
        return 1

    # -- batches -----------------------------------------------------------------------------------
    def take_batch(self, current: int) -> Batch | None:
        """A batch from what is pooled (no listing), or None if fewer than `groups_per_step` are usable."""
        return self._pool.take(current)

    def next_batch(
        self,
        current: int,
        *,
        timeout_s: float = 0.0,
        poll_interval_s: float = 2.0,
        stop_event: threading.Event | None = None,
    ) -> Batch | None:
        """Poll until a batch can be assembled, or return None after `timeout_s` (or on `stop_event`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll(current)
            batch = self.take_batch(current)
            if batch is not None:
                return batch
            left = deadline - time.monotonic()
            if left <= 0 or (stop_event is not None and stop_event.is_set()):
                return None
            wait = min(poll_interval_s, left)
            if stop_event is not None:
                stop_event.wait(wait)
            else:
                time.sleep(wait)

    # -- metrics and checkpoint state --------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Cumulative rollout/* and worker/* values (drops by reason, per-worker groups and lag)."""
        m = self.tally.metrics()
        m["rollout/pool"] = float(len(self._pool))
        m["rollout/list_calls"] = float(self.list_calls)
        return m

    def worker_stats(self) -> dict[str, dict]:
        """Per worker: groups accepted and used, drops by reason, newest version and last lag."""
        return self.tally.worker_stats()

    def ledger_state(self) -> dict:
        """The consumption ledger as JSON-ready data, for checkpoints."""
        return self._pool.ledger_state()

    def load_ledger_state(self, state: dict) -> None:
        """Restore a checkpoint's ledger; pooled entries pick up their recorded use counts."""
        self._pool.load_ledger_state(state)

    def run_poller(self, stop_event: threading.Event, interval_s: float) -> None:
        """Poll in the background (a thread's target) so batches are ready when the learner asks."""
        while not stop_event.wait(interval_s):
            if not self.current:
                continue  # nothing to list until the learner has said which version it is at
            try:
                self.poll(self.current)
            except Exception:  # the poller must outlive any surprise; the learner's own poll reports it
                log.exception("background poll failed")
