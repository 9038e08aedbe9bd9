"""The validated groups waiting for the learner, the reuse ledger, and the counts an operator reads.

`GroupPool` holds what passed trainer/rollout_rules.py and hands out `groups_per_step` groups at a time:
fresh groups first, then the newest policy, then first come. A group is used at most `reuse_cap` times;
the consumption ledger (record key -> uses) is saved with each checkpoint, so a restarted learner never
counts a group past the cap within the lineage that survives. `Tally` counts drops by reason and per
worker (accepted, used, lag). Thread-safe: the source's background poller and the learner share them.
Importable without torch or Ray.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_contract import layout
from worker_contract.schema import RolloutRecord
from worker_contract.tasks import MULTI_TURN_TASKS

from .rollout_rules import DROP_REASONS

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


@dataclass(frozen=True)
class BatchRules:
    """How the pool hands groups out."""

    groups_per_step: int
    """Prompt groups per batch."""
    reuse_cap: int
    """A group is used at most this many times."""

    def __post_init__(self) -> None:
        for name in ("groups_per_step", "reuse_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass
class _WorkerStats:
    accepted: int = 0
    used: int = 0
    drops: Counter = field(default_factory=Counter)
    last_version: int = 0
    last_lag: int = 0


class Tally:
    """Drops by reason, and per worker: groups accepted and used, drops, newest version and last lag."""

    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()
        self.accepted = 0
        self._workers: dict[str, _WorkerStats] = {}
        self._lock = threading.RLock()
        #: called as on_drop(key, reason) for every drop, when set: who needs to know which record went
        #: (an audit of a run's accounting, bench/fleet) keeps that list itself, the tally stays bounded
        self.on_drop: Callable[[str, str], None] | None = None

    def worker(self, worker: str) -> _WorkerStats:
        with self._lock:
            if worker not in self._workers and len(self._workers) >= MAX_TRACKED_WORKERS:
                worker = OTHER_WORKER
            return self._workers.setdefault(worker, _WorkerStats())

    def drop(self, reason: str, worker: str, key: str) -> None:
        assert reason in DROP_REASONS, reason
        with self._lock:
            self.drops[reason] += 1
            self.worker(worker).drops[reason] += 1
            if self.on_drop is not None:
                self.on_drop(key, reason)

    def accept(self, worker: str) -> None:
        with self._lock:
            self.accepted += 1
            self.worker(worker).accepted += 1

    def use(self, worker: str, version: int, lag: int) -> None:
        with self._lock:
            ws = self.worker(worker)
            ws.used += 1
            ws.last_version, ws.last_lag = max(ws.last_version, version), lag

    def metrics(self) -> dict[str, float]:
        """rollout/accepted, rollout/dropped, rollout/drops/<reason> and worker/<id>/*."""
        with self._lock:
            m: dict[str, float] = {"rollout/accepted": float(self.accepted),
                                   "rollout/dropped": float(sum(self.drops.values()))}
            for reason in DROP_REASONS:
                m[f"rollout/drops/{reason}"] = float(self.drops.get(reason, 0))
            for worker, ws in self._workers.items():
                m[f"worker/{worker}/groups"] = float(ws.accepted)
                m[f"worker/{worker}/used"] = float(ws.used)
                m[f"worker/{worker}/dropped"] = float(sum(ws.drops.values()))
                m[f"worker/{worker}/version_lag"] = float(ws.last_lag)
            return m

    def worker_stats(self) -> dict[str, dict]:
        with self._lock:
            return {w: {"groups": s.accepted, "used": s.used, "drops": dict(s.drops),
                        "last_version": s.last_version, "version_lag": s.last_lag}
                    for w, s in self._workers.items()}


@dataclass
class _Entry:
    key: str
    record: RolloutRecord
    version: int
    worker: str
    seq: int
    uses: int = 0


def _key_version(key: str) -> int:
    try:
        return layout.parse_rollout_key(key).version
    except ValueError:
        return 0


class GroupPool:
    """Usable groups by record key, their use counts (the ledger), and one key per (worker, group id)."""

    def __init__(self, rules: BatchRules, window: Callable[[int], range], tally: Tally, staleness: int):
        self.rules, self.window, self.tally, self.staleness = rules, window, tally, staleness
        self._entries: dict[str, _Entry] = {}
        self._ledger: dict[str, int] = {}
        self._ids: dict[tuple[str, str], str] = {}  # (worker, group_id) -> key, inside the window
        self._seq = 0
        self.current = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self):
        return iter(list(self._entries))

    def advance(self, current: int) -> int:
        """Move to `current` (never back) and forget what can never be used again; returns the version."""
        with self._lock:
            self.current = max(self.current, current)
            low = self.window(self.current).start
            for key, entry in list(self._entries.items()):
                if entry.version < low:
                    del self._entries[key]
                    if entry.uses == 0:
                        self.tally.drop("stale", entry.worker, key)
            for key in [k for k in self._ledger if _key_version(k) < low]:
                del self._ledger[key]
            for ident, key in list(self._ids.items()):
                if _key_version(key) < low:
                    del self._ids[ident]
            return self.current

    def admit(self, key: str, record: RolloutRecord, worker: str) -> str | None:
        """Pool a valid record; the drop reason instead if it duplicates a group or used up its cap."""
        with self._lock:
            other = self._ids.get((record.worker_id, record.group_id))
            if other is not None and other != key:
                return "duplicate"
            if self._ledger.get(key, 0) >= self.rules.reuse_cap:
                return "reuse_cap"
            self._seq += 1
            self._entries[key] = _Entry(key, record, record.policy_version, worker, self._seq,
                                        uses=self._ledger.get(key, 0))
            self._ids[(worker, record.group_id)] = key
            self.tally.accept(worker)
            return None

    def take(self, current: int) -> Batch | None:
        """A batch of `groups_per_step` groups, or None if fewer are usable."""
        with self._lock:
            current = self.advance(current)
            usable = [e for e in self._entries.values() if e.version <= current]
            if len(usable) < self.rules.groups_per_step:
                return None
            usable.sort(key=lambda e: (e.uses, -e.version, e.seq))  # fresh, then newest policy, then first come
            groups = []
            for e in usable[: self.rules.groups_per_step]:
                e.uses += 1
                self._ledger[e.key] = e.uses
                if e.uses >= self.rules.reuse_cap:
                    del self._entries[e.key]
                lag = current - e.version
                self.tally.use(e.worker, e.version, lag)
                groups.append(Group(e.key, e.record, e.uses, lag))
            return Batch(groups, current, self._batch_metrics(groups))

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
        if any(g.record.task in MULTI_TURN_TASKS for g in groups):  # tool episodes: a tool turn is a mask-0 span
            samples = [s for g in groups for s in g.record.samples]
            searched = [0 in s.loss_mask for s in samples]
            right = [s.reward >= 1.0 for s in samples]
            m["rollout/search_rate"] = sum(searched) / len(samples)
            m["rollout/correct_after_search"] = (sum(a and b for a, b in zip(right, searched, strict=True))
                                                 / sum(right)) if any(right) else 0.0
        return m

    # -- checkpoint state ------------------------------------------------------------------------------
    def ledger_state(self) -> dict:
        """The consumption ledger as JSON-ready data, for checkpoints."""
        with self._lock:
            return {"version": 1, "reuse_cap": self.rules.reuse_cap, "uses": dict(self._ledger)}

    def load_ledger_state(self, state: dict) -> None:
        """Restore a checkpoint's ledger; pooled entries pick up their recorded use counts."""
        if state.get("version") != 1 or not isinstance(state.get("uses"), dict):
            raise ValueError(f"ledger state {str(state)[:80]!r} is not a version-1 consumption ledger")
        with self._lock:
            self._ledger = {str(k): int(v) for k, v in state["uses"].items()}
            for key, entry in list(self._entries.items()):
                entry.uses = self._ledger.get(key, 0)
                if entry.uses >= self.rules.reuse_cap:
                    del self._entries[key]
