"""`invoke status --run <id>`: the state of a run, read from the bucket alone.

Nothing here talks to the trainer: a laptop with the join card sees what the trainer box sees. Listing
stays bounded by the run's recent versions (rollouts are filed by version, so the workers' view lists only
the few version prefixes around the pointer, and stats/patches start after a recent key); only the
bytes-by-prefix summary lists the whole run, page by page, and the watch loop refreshes it less often.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from worker_contract import layout
from worker_contract import pointer as pointer_mod
from worker_contract.anchor import anchor_versions
from worker_contract.manifest import RunManifest
from worker_contract.pointer import Pointer, PointerError
from worker_contract.schema import RecordError, decode_record
from worker_contract.store import NotFound, ObjectInfo, Store

from .cost import BucketUsage, CostEstimate, UsageAssumptions, bucket_usage, estimate_cost

#: versions before the pointer whose rollout prefixes the workers' view lists, beyond the staleness bound
EXTRA_VERSIONS_BACK = 4
#: stats objects and patches read for the publish table
RECENT_PUBLISHES = 12
#: records read for their created_at when the store's listing carries no modification time
MAX_RECORD_READS = 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class WorkerSeen(_Model):
    """One worker, as its rollout keys show it."""

    worker_id: str
    """The worker's id (a key segment of its rollouts)."""
    versions: list[int]
    """Policy versions it sampled from, within the listed window."""
    newest_version: int
    """The newest of them."""
    lag: int
    """Pointer version minus its newest version (0 = up to date)."""
    groups: int
    """Groups it uploaded within the listed window."""
    groups_recent: int | None
    """Groups uploaded in the last `window_min` minutes (None when no times are known)."""
    last_seen_s: float | None
    """Seconds since its newest upload (None when unknown)."""
    used: int | None = None
    """Its groups the learner trained on since the learner (last) started (its newest stats object; None if
    absent): a resumed learner counts from 0."""
    dropped: int | None = None
    """Its groups the learner dropped since the learner (last) started (its stats)."""
    logprob_mismatch: float | None = None
    """Mean |learner - recorded| behaviour log-prob per token (nats), trainer's audit (None if not audited)."""
    flagged: bool | None = None
    """True when the trainer's audit flags its log-probs (wrong weights, wrong plane, or edited)."""
    audited_version: int | None = None
    """Policy version of its newest group the audit compared (None if none): far below the pointer, the
    mismatch is old news (the audit sees only groups at the learner's exact weights)."""


class PublishSeen(_Model):
    """One published version, from its patch object and the trainer's stats object."""

    version: int
    """The version."""
    patch_bytes: int | None
    """Size of the patch that made it (None for anchors-only versions or unknown)."""
    latency_s: float | None
    """Seconds from the end of the learner step to the pointer moving (trainer's stats)."""
    groups: int | None
    """Groups the step consumed (trainer's stats)."""


class RunStatus(_Model):
    """Everything `status` shows; `--json` prints exactly this."""

    run: str
    """The run id."""
    store: str
    """The store URL (no secret in it)."""
    generated_at: float
    """Unix time this status was read."""
    manifest: dict | None
    """Contract fields of run.json (None if the run is not published)."""
    pointer_version: int | None
    """The version current.json names (None before the first publish)."""
    pointer_age_s: float | None
    """Seconds since the pointer was written."""
    pointer_anchor: int | None
    """The anchor the pointer names: where a cold join starts."""
    anchors: list[int]
    """Anchor versions with a manifest, oldest first."""
    window_min: float
    """Minutes that count as 'recent' for workers and rates."""
    workers: list[WorkerSeen]
    """Workers with uploads in the listed version window, most recent first."""
    active_workers: int
    """Workers seen within the last window_min minutes (or in the window when times are unknown)."""
    groups_per_minute: float | None
    """Uploads per minute over the last window_min minutes (None when times are unknown)."""
    staleness: dict[int, int]
    """Groups in the bucket's recent version prefixes by staleness (pointer version minus sampling version),
    trained on or not (which ones the learner used, the bucket does not say)."""
    staleness_consumed: dict[int, int]
    """Groups the learner trained on in the recent versions, by staleness (trainer's stats)."""
    drops: dict[str, int]
    """Groups dropped by the learner since the run began, by reason (the newest stats object)."""
    drops_recent: dict[str, int]
    """Groups dropped within the last few published versions, by reason."""
    publishes: list[PublishSeen]
    """The most recent published versions, newest first."""
    bytes_by_prefix: BucketUsage | None
    """The whole run's objects by prefix (None when skipped)."""
    cost: CostEstimate | None
    """Estimated R2 cost so far and per hour (for a file store: what it would cost on R2)."""
    remote: dict | None
    """The trainer box's own view (with --host), from infra.remote."""
    notes: list[str]
    """Anything the reader should know (missing objects, partial data)."""


def _mtime(o: ObjectInfo) -> float | None:
    """Modification time from the listing, when the store's ObjectInfo carries one."""
    t = getattr(o, "last_modified", None)
    if isinstance(t, datetime):
        return t.timestamp()
    return float(t) if isinstance(t, int | float) else None


def read_pointer(store: Store, run: str, public_key: str | None) -> Pointer | None:
    """The signed pointer (verified when `public_key` is given); None before the first publish."""
    return pointer_mod.read_pointer(store, run, public_key)[0]


def read_manifest(store: Store, run: str) -> RunManifest | None:
    """run.json, None if the run has none; a ValueError naming the object if it does not parse."""
    try:
        data = store.get(layout.manifest_key(run))
    except NotFound:
        return None
    try:
        return RunManifest.from_bytes(data)
    except ValueError as e:
        first = str(e).splitlines()[-2 if len(str(e).splitlines()) > 1 else 0].strip()
        raise ValueError(f"{layout.manifest_key(run)} in {store.url} is not a valid run manifest ({first}); "
                         "it is written once by the trainer: check the store and run id") from None


def _pointer_for_status(store: Store, run: str, manifest: RunManifest | None, notes: list[str]) -> Pointer | None:
    """The pointer, verified under run.json's key; one that does not verify is shown with a warning."""
    key = manifest.trainer_public_key if manifest else None
    try:
        return read_pointer(store, run, key)
    except PointerError as e:
        notes.append(f"current.json does not verify ({e}); workers refuse it")
    try:
        return read_pointer(store, run, None)
    except PointerError:
        return None


def recent_rollouts(store: Store, run: str, first: int, last: int) -> list[tuple[layout.RolloutKey, ObjectInfo]]:
    """Rollout keys under the version prefixes first..last (inclusive): the bounded listing."""
    out = []
    for v in range(max(first, 1), last + 1):
        for o in store.list(layout.rollout_version_prefix(run, v)):
            try:
                out.append((layout.parse_rollout_key(o.key), o))
            except ValueError:
                continue  # a stray object is not a worker's upload; the learner drops it too
    return out


def _upload_times(store: Store, items: list[tuple[layout.RolloutKey, ObjectInfo]],
                  cache: dict[str, float]) -> tuple[dict[str, float], bool]:
    """(key -> upload time, whether some were left unread). From the listing when it carries times, else the
    records' created_at: records are immutable, so `cache` keeps what earlier refreshes read, and each
    refresh reads at most MAX_RECORD_READS more, newest versions first."""
    times = {o.key: t for _, o in items if (t := _mtime(o)) is not None}
    if times or not items:
        return times, False
    todo = _newest_of_each_worker_in_turn([(k, o) for k, o in items if o.key not in cache])
    for o in todo[:MAX_RECORD_READS]:
        _created_at(store, o.key, cache)
    times = {o.key: cache[o.key] for _, o in items if o.key in cache and cache[o.key] == cache[o.key]}
    return times, len(todo) > MAX_RECORD_READS


def _created_at(store: Store, key: str, cache: dict[str, float]) -> float:
    """A record's created_at, read once: records are immutable, so `cache` keeps it across refreshes (nan for
    one that cannot be read: the learner drops it; it is never read again)."""
    if key not in cache:
        try:
            cache[key] = decode_record(store.get(key)).created_at
        except (NotFound, RecordError):
            cache[key] = float("nan")
    return cache[key]


def _newest_of_each_worker_in_turn(items: list[tuple[layout.RolloutKey, ObjectInfo]]) -> list[ObjectInfo]:
    """Each worker's uploads newest first (version, then key: the reference worker's group ids start with their
    time), dealt out one worker at a time, so a bounded read sees every worker's newest, not one worker's."""
    by_worker: dict[str, list[tuple[layout.RolloutKey, ObjectInfo]]] = {}
    for k, o in sorted(items, key=lambda kv: (kv[0].version, kv[1].key), reverse=True):
        by_worker.setdefault(k.worker_id, []).append((k, o))
    queues = [kos for _, kos in sorted(by_worker.items())]
    return [q[i][1] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def _rate_per_minute(wt: list[float], now: float, window_s: float, partial: bool) -> float:
    """Uploads a minute from one worker's known upload times: those in the window over the window; with a
    partial read whose records all fall inside the window (more may be unread there), n uploads span n - 1
    intervals between the first and the last (a single one says nothing of a rate: counted over the window)."""
    if partial and now - min(wt) < window_s and len(wt) >= 2 and max(wt) > min(wt):
        return (len(wt) - 1) / ((max(wt) - min(wt)) / 60)
    return sum(now - t <= window_s for t in wt) / (window_s / 60)


def _listing_reach(store: Store, run: str, first: int, times: dict[str, float], partial: bool, now: float,
                   window_s: float, cache: dict[str, float]) -> float | None:
    """Seconds the listed versions (from `first`) reach back when that is less than the window and the version
    below them holds uploads inside it (fast versions); None when the listing covers the window, or when only a
    partial read of it is known (each worker's own span is used then)."""
    below = _uploads_below(store, run, first, now - window_s, cache)
    reach = now - min(times.values()) if times else 0.0
    return reach if below and not partial and 0 < reach < window_s else None


def _uploads_below(store: Store, run: str, first: int, since: float, cache: dict[str, float]) -> bool:
    """Whether the version just below the listed ones holds an upload made after `since` (its newest record's
    created_at, cached): then the listing reaches back less than the window, as when versions come every few
    seconds."""
    if first - 1 < 1:
        return False
    newest = max((o.key for o in store.list(layout.rollout_version_prefix(run, first - 1))), default=None)
    return newest is not None and _created_at(store, newest, cache) > since  # False for nan


def summarize_workers(items, times: dict[str, float], pointer: int, now: float,
                      window_s: float, partial: bool = False,
                      reach_s: float | None = None) -> tuple[list[WorkerSeen], float | None]:
    """Per-worker rows and the upload rate over the window, summed over the workers. With `partial` times (each
    worker's newest records only) a worker's rate is its read uploads' own, over the time they span, and a
    worker none of whose records were read has no recent count (unknown, not 0) and adds nothing. Where the listed
    versions reach back less than the window (`reach_s`, _listing_reach: fast versions), the rate is over those
    seconds."""
    by_worker: dict[str, list[tuple[layout.RolloutKey, ObjectInfo]]] = {}
    for k, o in items:
        by_worker.setdefault(k.worker_id, []).append((k, o))
    rows = []
    for wid, kos in by_worker.items():
        versions = sorted({k.version for k, _ in kos})
        wt = [times[o.key] for _, o in kos if o.key in times]
        rows.append(WorkerSeen(
            worker_id=wid, versions=versions, newest_version=versions[-1], lag=pointer - versions[-1],
            groups=len(kos),
            groups_recent=sum(now - t <= window_s for t in wt) if wt else None,
            last_seen_s=(now - max(wt)) if wt else None,
        ))
    rows.sort(key=lambda r: (r.last_seen_s if r.last_seen_s is not None else float("inf"), r.lag, r.worker_id))
    rate = None
    if times:
        if reach_s is not None:
            rate = len(times) / (reach_s / 60)
        else:
            known = [[times[o.key] for _, o in kos if o.key in times] for kos in by_worker.values()]
            rate = sum(_rate_per_minute(wt, now, window_s, partial) for wt in known if wt)
    return rows, rate


def read_stats(store: Store, run: str, pointer: int) -> dict[int, dict]:
    """The trainer's per-version stats objects for the last RECENT_PUBLISHES versions."""
    start = layout.stats_key(run, pointer - RECENT_PUBLISHES) if pointer > RECENT_PUBLISHES else None
    out = {}
    for o in store.list(layout.stats_prefix(run), start_after=start):
        try:
            v = int(o.key.rsplit("/", 1)[1].split(".")[0][1:])
            data = json.loads(store.get(o.key))
        except (ValueError, NotFound):
            continue
        if isinstance(data, dict):  # anything else is not the trainer's (anyone with credentials can write)
            out[v] = data
    return out


def recent_patch_sizes(store: Store, run: str, pointer: int) -> dict[int, int]:
    start = layout.patch_key(run, pointer - RECENT_PUBLISHES) if pointer - RECENT_PUBLISHES >= 2 else None
    out = {}
    for o in store.list(layout.versions_prefix(run), start_after=start):
        try:
            v = layout.patch_version_of(o.key)
        except ValueError:
            continue  # a stray object, not a patch the trainer wrote
        if v is not None:
            out[v] = o.size
    return out


def _num(d: dict, *names: str) -> float | None:
    for n in names:
        if isinstance(d.get(n), int | float):
            return float(d[n])
    return None


def summarize_publishes(stats: dict[int, dict], patches: dict[int, int]) -> list[PublishSeen]:
    versions = sorted(set(stats) | set(patches), reverse=True)[:RECENT_PUBLISHES]
    rows = []
    for v in versions:
        s = stats.get(v, {})
        pub = s.get("publish", s) if isinstance(s.get("publish", s), dict) else s
        groups = _num(s, "groups", "groups_consumed")
        rows.append(PublishSeen(
            version=v, patch_bytes=patches.get(v, None) or (int(b) if (b := _num(pub, "patch_bytes")) else None),
            latency_s=_num(pub, "latency_s", "publish_latency_s"),
            groups=int(groups) if groups is not None else None,
        ))
    return rows


def consumed_staleness(stats: dict[int, dict]) -> dict[int, int]:
    """Sum of the learner's `rollout/staleness_hist/<lag>` over the stats objects read."""
    out: Counter[int] = Counter()
    prefix = "rollout/staleness_hist/"
    for s in stats.values():
        metrics = s.get("metrics")
        for k, v in (metrics if isinstance(metrics, dict) else {}).items():
            if k.startswith(prefix) and k[len(prefix):].isdigit() and isinstance(v, int | float):
                out[int(k[len(prefix):])] += int(v)
    return dict(sorted((lag, n) for lag, n in out.items() if n))


def add_learner_counts(workers: list[WorkerSeen], stats: dict[int, dict]) -> None:
    """Per-worker used/dropped totals from the newest stats object that has them."""
    newest = next((stats[v]["workers"] for v in sorted(stats, reverse=True)
                   if isinstance(stats[v].get("workers"), dict) and stats[v]["workers"]), {})
    for w in workers:
        ws = newest.get(w.worker_id)
        if isinstance(ws, dict):
            drops = ws.get("drops")
            w.used = int(ws["used"]) if isinstance(ws.get("used"), int | float) else None
            w.dropped = (sum(int(n) for n in drops.values() if isinstance(n, int | float))
                         if isinstance(drops, dict) else None)
            mismatch = ws.get("logprob_mismatch")
            w.logprob_mismatch = float(mismatch) if isinstance(mismatch, int | float) else None
            w.flagged = ws["flagged"] if isinstance(ws.get("flagged"), bool) else None
            audited = ws.get("audited_version")
            w.audited_version = audited if isinstance(audited, int) and not isinstance(audited, bool) else None


def sum_drops(stats: dict[int, dict]) -> tuple[dict[str, int], dict[str, int]]:
    """(drops since the learner (last) started, from the newest stats object; drops within the stats window
    read)."""
    recent: Counter[str] = Counter()
    for s in stats.values():
        drops = s.get("drops") or {}
        if isinstance(drops, dict):
            recent.update({str(k): int(v) for k, v in drops.items() if isinstance(v, int | float)})
    newest = stats[max(stats)] if stats else {}
    total = newest.get("drops_total") if isinstance(newest.get("drops_total"), dict) else {}
    total = {str(k): int(v) for k, v in total.items() if isinstance(v, int | float)}
    order = lambda d: dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))  # noqa: E731
    return order(total), order(dict(recent))


_MANIFEST_FIELDS = ("n_samples", "plane", "kv_mode", "task", "model_id", "staleness", "anchor_interval",
                    "created_at")


def collect_status(
    store: Store,
    run: str,
    *,
    window_min: float = 5.0,
    include_bytes: bool = True,
    bytes_cache: BucketUsage | None = None,
    now: float | None = None,
    record_times: dict[str, float] | None = None,
    advance: Callable[[float], None] = lambda n=1: None,
) -> RunStatus:
    """Read the run's state from the bucket (see the module docstring for what is listed).

    `bytes_cache` reuses an earlier bytes-by-prefix summary (skipping the full listing); `record_times`
    carries records' upload times between refreshes (`--watch`).
    """
    layout.check_run_id(run)
    now = time.time() if now is None else now
    notes: list[str] = []
    manifest = read_manifest(store, run)
    if manifest is None:
        notes.append(f"{layout.manifest_key(run)} is absent: the run has not been published in {store.url}")
    ptr = _pointer_for_status(store, run, manifest, notes)
    pointer = ptr.version if ptr else None
    anchors = anchor_versions(store, run)
    staleness_bound = manifest.staleness if manifest else 3
    activity: dict = {"workers": [], "groups_per_minute": None, "staleness": {}, "staleness_consumed": {},
                      "drops": {}, "drops_recent": {}, "publishes": []}
    if pointer is None and not store.exists(layout.pointer_key(run)):
        notes.append("no pointer yet (current.json): the trainer has not published version 1")
    elif pointer is None:
        notes.append("current.json is unreadable (the note above says why): nothing beyond run.json is shown")
    else:
        activity = _activity(store, run, pointer, staleness_bound, now, window_min * 60,
                             {} if record_times is None else record_times, notes)
    active = sum(1 for w in activity["workers"] if w.groups_recent is None or w.groups_recent > 0)
    usage = bytes_cache
    if usage is None and include_bytes:
        usage = bucket_usage(store, run, advance=advance)
    cost = None
    if usage is not None and manifest is not None:  # on a file store: what the run would cost on R2
        cost = estimate_cost(usage, elapsed_s=now - manifest.created_at, versions=pointer or 0,
                             workers=max(active, 1), staleness=staleness_bound,
                             assumptions=UsageAssumptions())
    return RunStatus(
        run=run, store=store.url, generated_at=now,
        manifest={k: getattr(manifest, k) for k in _MANIFEST_FIELDS} if manifest else None,
        pointer_version=pointer, pointer_age_s=(now - ptr.published_at) if ptr else None,
        pointer_anchor=ptr.anchor_version if ptr else None, anchors=anchors,
        window_min=window_min, active_workers=active, **activity,
        bytes_by_prefix=usage, cost=cost, remote=None, notes=notes,
    )


def _activity(store: Store, run: str, pointer: int, staleness_bound: int, now: float, window_s: float,
              record_times: dict[str, float], notes: list[str]) -> dict:
    """What happened near the pointer, as RunStatus fields: the workers' uploads (per worker, the rate, the
    staleness histogram) and what the trainer's recent stats objects and patches say."""
    first = pointer - staleness_bound - EXTRA_VERSIONS_BACK
    items = recent_rollouts(store, run, first, pointer + 1)
    times, partial = _upload_times(store, items, record_times)
    reach_s = _listing_reach(store, run, first, times, partial, now, window_s, record_times)
    if partial:
        notes.append(f"upload times read from {MAX_RECORD_READS} records only, each worker's newest in turn (more "
                     "each refresh): groups/min sums each worker's rate over its read records, and a worker none of "
                     "whose records were read shows no recent count")
    workers, rate = summarize_workers(items, times, pointer, now, window_s, partial, reach_s)
    if reach_s is not None:
        notes.append(f"the listed versions (the pointer back to staleness + {EXTRA_VERSIONS_BACK}) reach back "
                     f"{reach_s:.0f} s, less than the {window_s / 60:g}-minute window (versions come fast): groups/min "
                     "is over those seconds, and each worker's recent count covers only them")
    stats = read_stats(store, run, pointer)
    drops, recent = sum_drops(stats)
    consumed = consumed_staleness(stats)
    add_learner_counts(workers, stats)
    return {"workers": workers, "groups_per_minute": rate,
            "staleness": dict(sorted(Counter(pointer - k.version for k, _ in items).items())),
            "staleness_consumed": consumed, "drops": drops, "drops_recent": recent,
            "publishes": summarize_publishes(stats, recent_patch_sizes(store, run, pointer))}
