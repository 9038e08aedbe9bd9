"""The bucket-backed rollout source: polls the store, validates every record, assembles batches.

Workers write one immutable record per prompt group under `rollouts/v<version>/<worker>/<group>.json.zst`
(worker_contract/layout.py). The source lists only the version prefixes inside the staleness window
[current - staleness, current], so its listing cost is bounded by that window, never by the run's
history. Per prefix it remembers the last key it saw and lists from there (`start_after`); because a
worker whose id sorts early can upload after one that sorts late, every `sweep_every` polls it lists each
window prefix whole once more (still window-bounded) and takes only keys it has not seen. When a version
leaves the window its prefix is listed whole one last time and every group never read is counted as a
`stale` drop (uploaded after the last poll that covered it); groups uploaded under a version after that
are not listed, so this count is a floor.

Every record is checked; a bad one is dropped with a counted reason (DROP_REASONS) and never stops the
learner. A prompt group is used at most `reuse_cap` times; the consumption ledger (record key -> uses) is
saved with each checkpoint, so a restarted learner never counts a group past the cap within the lineage
that survives. Importable without torch or Ray (slime loads it by path).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker_contract import layout
from worker_contract.schema import MAX_RECORD_BYTES, RecordError, RolloutRecord, decode_record
from worker_contract.store import NotFound, ObjectInfo, Store, StoreError

if TYPE_CHECKING:
    from worker_contract.manifest import RunManifest

    from .config import AlgoConfig

log = logging.getLogger(__name__)

#: every reason a record can be dropped for, with what it means (the metric is rollout/drops/<reason>)
DROP_REASONS: dict[str, str] = {
    "bad_key": "the key does not parse as <run>/rollouts/v<version>/<worker>/<group>.json.zst",
    "oversized": "object larger than the record size limit",
    "malformed": "not zstd, not JSON, does not follow the record schema, or has an empty prompt",
    "schema_version": "a record format this learner does not read",
    "length_mismatch": "response tokens, log-probs and loss mask differ in length",
    "wrong_run": "the record names another run",
    "future_version": "sampled by a policy version newer than the newest published one",
    "stale": "sampled more than `staleness` versions ago (never used before it aged out)",
    "key_mismatch": "version, worker or group in the key differs from the record",
    "wrong_plane": "sampled on another weight plane (DRL_PULSE_PLANE)",
    "group_size": "group size differs from DRL_N_SAMPLES",
    "sampling_mismatch": "temperature, top_p or max_new_tokens differs from the run's",
    "vocab": "a token id outside [0, vocab_size)",
    "too_long": "a response longer than max_new_tokens (the budget covers sampled and tool tokens)",
    "logprob_not_finite": "a behaviour log-prob is NaN or infinite",
    "logprob_positive": "a behaviour log-prob is above 0 (a probability above 1)",
    "reward_not_finite": "a reward is NaN or infinite",
    "duplicate": "the same worker/group id under a second key",
    "reuse_cap": "the group was already used `reuse_cap` times",
    "vanished": "listed, then gone before it could be read",
}
#: log-probs up to this far above 0 are rounding noise of the worker's softmax, not an error
LOGPROB_POSITIVE_TOL = 1e-4
#: per-worker stats are kept for this many worker ids; the rest are pooled under OTHER_WORKER
MAX_TRACKED_WORKERS = 4096
OTHER_WORKER = "_other"


@dataclass
class Group:
    """One prompt group handed to the learner."""

    key: str
    record: RolloutRecord
    use: int
    """Which use this is (1 = first)."""
    lag: int
    """Learner version minus the record's policy version when the batch was assembled."""


@dataclass
class Batch:
    groups: list[Group]
    current_version: int
    """The learner version the batch was assembled for (the newest published one)."""
    metrics: dict[str, float]
    """rollout/* values of this batch (reward, staleness histogram, reuse)."""


@dataclass
class _Entry:
    key: str
    record: RolloutRecord
    version: int
    worker: str
    seq: int
    uses: int = 0


@dataclass
class _WorkerStats:
    accepted: int = 0
    used: int = 0
    drops: Counter = field(default_factory=Counter)
    last_version: int = 0
    last_lag: int = 0


class RolloutSource:
    """Validated prompt groups from the bucket, `groups_per_step` at a time."""

    def __init__(
        self,
        store: Store,
        *,
        run: str,
        n_samples: int,
        plane: str,
        vocab_size: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        staleness: int,
        reuse_cap: int,
        groups_per_step: int,
        max_record_bytes: int = MAX_RECORD_BYTES,
        sweep_every: int = 10,
    ):
        for name, value, low in (("staleness", staleness, 0), ("reuse_cap", reuse_cap, 1),
                                 ("groups_per_step", groups_per_step, 1), ("n_samples", n_samples, 1),
                                 ("vocab_size", vocab_size, 1), ("sweep_every", sweep_every, 1)):
            if value < low:
                raise ValueError(f"{name}={value} must be at least {low}")
        self.store = store
        self.run = layout.check_run_id(run)
        self.n_samples, self.plane, self.vocab_size = n_samples, plane, vocab_size
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.staleness, self.reuse_cap, self.groups_per_step = staleness, reuse_cap, groups_per_step
        self.max_record_bytes, self.sweep_every = max_record_bytes, sweep_every
        self.drops: Counter[str] = Counter()
        self.accepted = 0
        self.list_calls = 0
        self._ledger: dict[str, int] = {}
        self._pool: dict[str, _Entry] = {}
        self._ids: dict[tuple[str, str], str] = {}  # (worker, group_id) -> key, inside the window
        self._last_seen: dict[str, str] = {}  # prefix -> last key listed
        self._seen: dict[str, set[str]] = defaultdict(set)  # prefix -> keys handled
        self._listed: set[int] = set()  # versions listed in the window, to be retired when they leave it
        self._workers: dict[str, _WorkerStats] = {}
        self._polls = 0
        self._seq = 0
        self._current = 0
        self._lock = threading.RLock()  # pool, ledger, counters
        self._poll_lock = threading.Lock()  # one poll at a time (I/O happens outside _lock)

    @classmethod
    def from_manifest(cls, store: Store, manifest: RunManifest, algo: AlgoConfig, **kw) -> RolloutSource:
        """A source that checks records against the run's published contract and the recipe."""
        return cls(store, run=manifest.run, n_samples=manifest.n_samples, plane=manifest.plane,
                   vocab_size=manifest.vocab_size, temperature=manifest.temperature, top_p=manifest.top_p,
                   max_new_tokens=manifest.max_new_tokens, staleness=algo.staleness,
                   reuse_cap=algo.reuse_cap, groups_per_step=algo.groups_per_step, **kw)

    # -- listing -----------------------------------------------------------------------------------
    def window(self, current: int) -> range:
        """Policy versions a record may carry when the learner is at `current`."""
        return range(max(1, current - self.staleness), current + 1)

    def poll(self, current: int) -> int:
        """List the window's prefixes for new records, validate them, pool the good ones; returns how many."""
        with self._poll_lock:
            with self._lock:
                self._current = max(self._current, current)
                current = self._current
                self._forget_outside(current)
            self._forget_listing(current)
            self._polls += 1
            sweep = self._polls % self.sweep_every == 0
            added = 0
            for version in self.window(current):
                self._listed.add(version)
                prefix = layout.rollout_version_prefix(self.run, version)
                for info in self._list(prefix, None if sweep else self._last_seen.get(prefix)):
                    added += self._ingest(info, prefix, current)
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

    def _forget_listing(self, current: int) -> None:
        """Retire versions that left the window (called under the poll lock): list each prefix whole once
        more, count the groups never read as `stale`, then forget its listing state. A listing that fails
        is retried at the next poll, so no version's count is skipped."""
        low = self.window(current).start
        for version in sorted(v for v in self._listed if v < low):
            prefix = layout.rollout_version_prefix(self.run, version)
            try:
                infos = self._list_counted(prefix)
            except StoreError as e:
                log.warning("listing %s one last time failed, will retry: %s", prefix, e)
                continue
            seen = self._seen.pop(prefix, set())
            for info in infos:
                if info.key not in seen:
                    try:
                        self._drop("stale", layout.parse_rollout_key(info.key).worker_id)
                    except ValueError:
                        self._drop("bad_key", OTHER_WORKER)
            self._last_seen.pop(prefix, None)
            self._listed.discard(version)

    def _forget_outside(self, current: int) -> None:
        """Pool, ledger and id entries that can never be used again (called under the lock)."""
        low = self.window(current).start
        for key, entry in list(self._pool.items()):
            if entry.version < low:
                del self._pool[key]
                if entry.uses == 0:
                    self._drop("stale", entry.worker)
        for key in [k for k in self._ledger if self._key_version(k) < low]:
            del self._ledger[key]
        for ident, key in list(self._ids.items()):
            if self._key_version(key) < low:
                del self._ids[ident]

    @staticmethod
    def _key_version(key: str) -> int:
        try:
            return layout.parse_rollout_key(key).version
        except ValueError:
            return 0

    # -- validation --------------------------------------------------------------------------------
    def _ingest(self, info: ObjectInfo, prefix: str, current: int) -> int:
        seen = self._seen[prefix]
        if info.key in seen:
            return 0
        try:
            parsed = layout.parse_rollout_key(info.key)
        except ValueError:
            seen.add(info.key)
            self._drop("bad_key", OTHER_WORKER)
            return 0
        worker = parsed.worker_id
        if info.size > self.max_record_bytes:
            seen.add(info.key)
            self._drop("oversized", worker)
            return 0
        try:
            blob = self.store.get(info.key)
        except NotFound:
            seen.add(info.key)
            self._drop("vanished", worker)
            return 0
        except StoreError as e:  # not marked seen: the next sweep retries it
            log.warning("reading %s failed, will retry: %s", info.key, e)
            return 0
        seen.add(info.key)
        try:
            record = decode_record(blob)
        except RecordError as e:
            self._drop(e.reason if e.reason in DROP_REASONS else "malformed", worker)
            return 0
        reason = self.check(record, parsed, current)
        with self._lock:
            if reason is None:
                reason = self._check_ledger(info.key, record)
            if reason is not None:
                self._drop(reason, worker)
                return 0
            self._seq += 1
            self._pool[info.key] = _Entry(info.key, record, record.policy_version, worker, self._seq,
                                          uses=self._ledger.get(info.key, 0))
            self._ids[(worker, record.group_id)] = info.key
            self.accepted += 1
            self._worker(worker).accepted += 1
        return 1

    def check(self, rec: RolloutRecord, key: layout.RolloutKey, current: int) -> str | None:
        """The drop reason for a decoded record, or None if the learner may use it."""
        if rec.run != self.run or key.run != self.run:
            return "wrong_run"
        if rec.policy_version > current:
            return "future_version"
        if current - rec.policy_version > self.staleness:
            return "stale"
        if (key.version, key.worker_id, key.group_id) != (rec.policy_version, rec.worker_id, rec.group_id):
            return "key_mismatch"
        if rec.plane != self.plane:
            return "wrong_plane"
        if len(rec.samples) != self.n_samples:
            return "group_size"
        sp = rec.sampling
        if (not math.isclose(sp.temperature, self.temperature, rel_tol=1e-6) or
                not math.isclose(sp.top_p, self.top_p, rel_tol=1e-6) or sp.max_new_tokens != self.max_new_tokens):
            return "sampling_mismatch"
        if not rec.prompt_ids:
            return "malformed"  # nothing would predict the first response token
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in rec.prompt_ids):
            return "vocab"
        for s in rec.samples:
            if len(s.response_ids) > self.max_new_tokens:
                return "too_long"  # a hostile length would otherwise reach the learner's forward
            if any(not 0 <= t < vocab for t in s.response_ids):
                return "vocab"
            if len(s.behavior_logprobs) != len(s.response_ids):
                return "length_mismatch"
            if not all(math.isfinite(x) for x in s.behavior_logprobs):
                return "logprob_not_finite"
            if any(x > LOGPROB_POSITIVE_TOL for x in s.behavior_logprobs):
                return "logprob_positive"
            if not math.isfinite(s.reward):
                return "reward_not_finite"
        return None

    def _check_ledger(self, key: str, rec: RolloutRecord) -> str | None:
        other = self._ids.get((rec.worker_id, rec.group_id))
        if other is not None and other != key:
            return "duplicate"
        if self._ledger.get(key, 0) >= self.reuse_cap:
            return "reuse_cap"
        return None

    def _worker(self, worker: str) -> _WorkerStats:
        if worker not in self._workers and len(self._workers) >= MAX_TRACKED_WORKERS:
            worker = OTHER_WORKER
        return self._workers.setdefault(worker, _WorkerStats())

    def _drop(self, reason: str, worker: str) -> None:
        assert reason in DROP_REASONS, reason
        with self._lock:
            self.drops[reason] += 1
            self._worker(worker).drops[reason] += 1

    # -- batches -----------------------------------------------------------------------------------
    def take_batch(self, current: int) -> Batch | None:
        """A batch from what is pooled (no listing), or None if fewer than `groups_per_step` are usable."""
        with self._lock:
            self._current = max(self._current, current)
            current = self._current
            self._forget_outside(current)
            usable = [e for e in self._pool.values() if e.version <= current]
            if len(usable) < self.groups_per_step:
                return None
            # fresh groups first, then newest policy, then first come
            usable.sort(key=lambda e: (e.uses, -e.version, e.seq))
            groups = []
            for e in usable[: self.groups_per_step]:
                e.uses += 1
                self._ledger[e.key] = e.uses
                if e.uses >= self.reuse_cap:
                    del self._pool[e.key]
                lag = current - e.version
                ws = self._worker(e.worker)
                ws.used += 1
                ws.last_version, ws.last_lag = max(ws.last_version, e.version), lag
                groups.append(Group(e.key, e.record, e.uses, lag))
            return Batch(groups, current, self._batch_metrics(groups))

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

    def _batch_metrics(self, groups: list[Group]) -> dict[str, float]:
        rewards = [s.reward for g in groups for s in g.record.samples]
        lengths = [len(s.response_ids) for g in groups for s in g.record.samples]
        m: dict[str, float] = {
            "rollout/raw_reward": sum(rewards) / len(rewards),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/staleness_mean": sum(g.lag for g in groups) / len(groups),
            "rollout/reused_frac": sum(g.use > 1 for g in groups) / len(groups),
        }
        for lag in range(self.staleness + 1):
            m[f"rollout/staleness_hist/{lag}"] = float(sum(g.lag == lag for g in groups))
        return m

    # -- metrics and checkpoint state --------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Cumulative rollout/* and worker/* values (drops by reason, per-worker groups and lag)."""
        with self._lock:
            m: dict[str, float] = {
                "rollout/accepted": float(self.accepted),
                "rollout/pool": float(len(self._pool)),
                "rollout/dropped": float(sum(self.drops.values())),
                "rollout/list_calls": float(self.list_calls),
            }
            for reason in DROP_REASONS:
                m[f"rollout/drops/{reason}"] = float(self.drops.get(reason, 0))
            for worker, ws in self._workers.items():
                m[f"worker/{worker}/groups"] = float(ws.accepted)
                m[f"worker/{worker}/used"] = float(ws.used)
                m[f"worker/{worker}/dropped"] = float(sum(ws.drops.values()))
                m[f"worker/{worker}/version_lag"] = float(ws.last_lag)
            return m

    def worker_stats(self) -> dict[str, dict]:
        """Per worker: groups accepted and used, drops by reason, newest version and last lag."""
        with self._lock:
            return {w: {"groups": s.accepted, "used": s.used, "drops": dict(s.drops),
                        "last_version": s.last_version, "version_lag": s.last_lag}
                    for w, s in self._workers.items()}

    def ledger_state(self) -> dict:
        """The consumption ledger as JSON-ready data, for checkpoints."""
        with self._lock:
            return {"version": 1, "reuse_cap": self.reuse_cap, "uses": dict(self._ledger)}

    def load_ledger_state(self, state: dict) -> None:
        """Restore a checkpoint's ledger; pooled entries pick up their recorded use counts."""
        if state.get("version") != 1 or not isinstance(state.get("uses"), dict):
            raise ValueError(f"ledger state {str(state)[:80]!r} is not a version-1 consumption ledger")
        with self._lock:
            self._ledger = {str(k): int(v) for k, v in state["uses"].items()}
            for key, entry in list(self._pool.items()):
                entry.uses = self._ledger.get(key, 0)
                if entry.uses >= self.reuse_cap:
                    del self._pool[key]

    def run_poller(self, stop_event: threading.Event, interval_s: float) -> None:
        """Poll in the background (a thread's target) so batches are ready when the learner asks."""
        while not stop_event.wait(interval_s):
            if not self._current:
                continue  # nothing to list until the learner has said which version it is at
            try:
                self.poll(self._current)
            except Exception:  # the poller must outlive any surprise; the learner's own poll reports it
                log.exception("background poll failed")
