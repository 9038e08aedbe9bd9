"""What makes a rollout record usable, and the validated groups waiting for the learner.

`RecordRules` judges each record against the run's contract (run.json: group size, plane, vocabulary,
sampling) and the staleness window; a bad one gets one of DROP_REASONS (counted as
`rollout/drops/<reason>`, never raised). `GroupPool` holds what passed and hands out `groups_per_step`
groups at a time: fresh first, then the newest policy, then first come; a group is used at most
`reuse_cap` times, and the ledger of uses is saved with each checkpoint. `Tally` counts drops and per
worker. Thread-safe (the source's poller and the learner share them); no I/O; importable without torch or
Ray. The listing is trainer/rollouts/source.py's.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from worker_contract import layout
from worker_contract.routes import RouteError, RouteShape, decode_routes
from worker_contract.schema import MAX_RECORD_BYTES, RolloutRecord
from worker_contract.tasks import Task

if TYPE_CHECKING:
    from worker_contract.manifest import RunManifest


class AlgoSection(Protocol):
    """What the rollouts read of the recipe's algo section (trainer/config.py's AlgoConfig has each)."""

    staleness: int
    routing_replay: bool
    groups_per_step: int
    reuse_cap: int

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
    "wrong_task": "the record names another task than the run's (its reward and prompts are another task's)",
    "group_size": "group size differs from DRL_N_SAMPLES",
    "sampling_mismatch": "temperature, top_p or max_new_tokens differs from the run's",
    "vocab": "a token id outside [0, vocab_size)",
    "too_long": "a response longer than max_new_tokens (the budget covers sampled and tool tokens)",
    "logprob_not_finite": "a behaviour log-prob is NaN or infinite",
    "logprob_positive": "a behaviour log-prob is above 0 (a probability above 1)",
    "reward_not_finite": "a reward is NaN or infinite",
    "routes_unexpected": "MoE routes on a run of a dense model",
    "routes_missing": "no MoE routes on a run that replays them (algo.routing_replay)",
    "routes_shape": "routes of another layer count or top-k than the model's, undecodable, or not one per routed token",
    "routes_range": "an expert id outside [0, num_experts), or one repeated within a token's top-k",
    "duplicate": "the same worker/group id under a second key",
    "reuse_cap": "the group was already used `reuse_cap` times",
    "vanished": "listed, then gone before it could be read",
}
#: log-probs up to this far above 0 are rounding noise of the worker's softmax, not an error
LOGPROB_POSITIVE_TOL = 1e-4


@dataclass(frozen=True)
class RecordRules:
    """The contract a record must follow to be trained on, and the staleness window it must fall in."""

    run: str
    n_samples: int
    plane: str
    vocab_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    staleness: int
    max_record_bytes: int = MAX_RECORD_BYTES
    routes: RouteShape | None = None
    """The model's MoE route shape (None: a dense model, whose records carry no routes)."""
    replay: bool = False
    """algo.routing_replay: a record of an MoE model must carry its routes."""
    task: str | None = None
    """The run's task (run.json); None: any task the worker names (rules built by hand, without a run)."""

    def __post_init__(self) -> None:
        layout.check_run_id(self.run)
        for name, low in (("staleness", 0), ("n_samples", 1), ("vocab_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {low}")

    @classmethod
    def from_manifest(cls, manifest: RunManifest, algo: AlgoSection, **kw) -> RecordRules:
        """The run's published contract (run.json), the recipe's staleness bound and its routing replay;
        `routes=` the model's route shape (worker_contract/routes.py)."""
        return cls(run=manifest.run, n_samples=manifest.n_samples, plane=manifest.plane,
                   vocab_size=manifest.vocab_size, temperature=manifest.temperature, top_p=manifest.top_p,
                   max_new_tokens=manifest.max_new_tokens, staleness=algo.staleness,
                   replay=algo.routing_replay, task=manifest.task, **kw)

    def window(self, current: int) -> range:
        """Policy versions a record may carry when the learner is at `current`."""
        return range(max(1, current - self.staleness), current + 1)

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
        if self.task is not None and rec.task != self.task:
            return "wrong_task"
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
        return self._check_routes(rec)

    def _check_routes(self, rec: RolloutRecord) -> str | None:
        """Routes are checked whether or not the run replays them: a hostile worker's group goes either way."""
        if rec.routes is None:
            return "routes_missing" if self.replay and self.routes is not None else None
        if self.routes is None:
            return "routes_unexpected"
        try:
            decode_routes(rec, self.routes)
        except RouteError as e:
            return e.reason
        return None


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

    def __init__(self, rules: BatchRules, window: Callable[[int], range], tally: Tally, staleness: int,
                 task: Task | None = None):
        self.rules, self.window, self.tally, self.staleness = rules, window, tally, staleness
        self.task = task
        """The run's task, built once, for its own batch metrics (None: the pool's metrics only)."""
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
        if self.task is not None:  # the task's own metrics (another task's records were dropped as wrong_task)
            m.update(self.task.batch_metrics([s for g in groups for s in g.record.samples]))
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
