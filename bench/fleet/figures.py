"""The figures of one fleet run, from what the learner logged, what the workers reported and what the wire
counted: throughput, the learner's polls and requests, the workers' polling, upload-to-use latency, the
cold-join storm, the learner's memory, and the R2 bill (infra/ops/cost.py's prices and estimator)."""

from __future__ import annotations

from collections import Counter

from infra.ops.cost import GB, HOURS_PER_MONTH, R2Prices, UsageAssumptions, estimate_cost, summarize_objects
from worker_contract.store import ObjectInfo

from .wire import CLASS_A, CLASS_B


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def _sum(counter: dict, role: str | None = None, op: str | None = None, kind: str | None = None) -> int:
    total = 0
    for k, v in counter.items():
        r, o, kd = k.split(" ")
        if (role is None or r == role) and (op is None or o == op) and (kind is None or kd == kind):
            total += v
    return total


def throughput(learner: dict, elapsed_s: float) -> dict:
    steps = len(learner["steps"])
    firsts = [u for u in learner["uses"] if u[1] == 1]
    return {
        "steps": steps,
        "groups_ingested": learner["accepted"],
        "groups_ingested_per_s": round(learner["accepted"] / elapsed_s, 3),
        "groups_ingested_per_step": round(learner["accepted"] / max(steps, 1), 2),
        "groups_used_per_step": round(len(learner["uses"]) / max(steps, 1), 2),
        "fresh_groups_per_step": round(len(firsts) / max(steps, 1), 2),
        "drops": learner["drops"],
        "upload_to_use_s": {"p50": pct([u[2] for u in firsts], 0.5), "p99": pct([u[2] for u in firsts], 0.99),
                            "n": len(firsts)},
        "lag_versions": dict(sorted(Counter(u[3] for u in learner["uses"]).items())),
        "publish_s": {"p50": pct([p["s"] for p in learner["publishes"]], 0.5),
                      "p99": pct([p["s"] for p in learner["publishes"]], 0.99)},
        "publish_failures": learner["publish_failures"],
    }


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals (the poller and next_batch may wait on each other)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def learner_figures(learner: dict, wire: dict, elapsed_s: float) -> dict:
    polls = learner["polls"]
    steps = max(len(learner["steps"]), 1)
    billed = wire["billed"]
    by_op = Counter()
    for k, v in billed.items():
        r, o, kd = k.split(" ")
        if r == "learner":
            by_op[f"{o} {kd}"] += v
    return {
        "polls": len(polls),
        "poll_s": {"p50": pct([p[1] for p in polls], 0.5), "p99": pct([p[1] for p in polls], 0.99),
                   "mean": round(sum(p[1] for p in polls) / max(len(polls), 1), 4),
                   "max": round(max((p[1] for p in polls), default=0.0), 4)},
        "poll_busy_frac": round(_covered([(end - dt, end) for end, dt, _, _ in polls]) / elapsed_s, 3),
        "lists_per_poll": round(sum(p[2] for p in polls) / max(len(polls), 1), 2),
        "slowest_polls": [{"end": round(end - polls[0][0], 1), "s": round(dt, 2), "lists": lists, "added": added}
                          for end, dt, lists, added in sorted(polls, key=lambda p: -p[1])[:6]] if polls else [],
        "requests_per_step": round(_sum(billed, "learner") / steps, 1),
        "list_requests_per_step": round(_sum(billed, "learner", "LIST") / steps, 1),
        "record_reads_per_step": round(_sum(billed, "learner", "GET", "rollout") / steps, 1),
        "requests_by_op": dict(sorted(by_op.items())),
    }


def worker_figures(workers: list[dict], wire: dict, stop_wall: float) -> dict:
    hours = 0.0
    for w in workers:
        if w["joins"]:
            hours += max(0.0, stop_wall - w["joins"][0]["t0"]) / 3600
    billed = wire["billed"]
    per_hour = lambda n: round(n / hours, 1) if hours else None  # noqa: E731
    joins = [j for w in workers for j in w["joins"]]
    return {
        "worker_hours": round(hours, 3),
        "pointer_polls_per_worker_hour": per_hour(_sum(billed, "worker", "GET", "pointer")),
        "anchor_requests_per_worker_hour": per_hour(_sum(billed, "worker", "GET", "anchor")),
        "patch_requests_per_worker_hour": per_hour(_sum(billed, "worker", "GET", "patch")),
        "uploads_per_worker_hour": per_hour(_sum(billed, "worker", "PUT", "rollout")),
        "requests_per_worker_hour": per_hour(_sum(billed, "worker")),
        "joins": len(joins), "join_failures": sum("error" in j for j in joins),
        "crashes": sum(w["crashes"] for w in workers),
        "follow_failures": sum(w["follow_failures"] for w in workers),
        "upload_failures": sum(w["upload_failures"] for w in workers),
    }


def storm_figures(storm: list[dict], wire: dict, wall0: float) -> dict | None:
    """Join time of the workers that joined at once, and what the wire did meanwhile."""
    if not storm:
        return None
    done = [w["joins"] for w in storm if any("version" in j for j in w["joins"])]
    starts = [w["joins"][0]["t0"] for w in storm if w["joins"]]
    if not starts:
        return {"workers": len(storm), "joined": 0}
    begin = min(starts)
    ends = [next(j["t1"] for j in js if "version" in j) for js in done]
    seconds = {int(s): c for s, c in wire["timeline"].items()}
    first, last = int(begin - wall0), int(max(ends, default=begin) - wall0) + 1
    window = [seconds.get(s, {}) for s in range(first, last + 1)]
    return {
        "workers": len(storm), "joined": len(done),
        "join_s": {"p50": pct([e - begin for e in ends], 0.5), "p99": pct([e - begin for e in ends], 0.99),
                   "max": round(max(ends) - begin, 3) if ends else None},
        "failed_attempts": sum(sum("error" in j for j in w["joins"]) for w in storm),
        "requests_per_s_peak": max((c.get("requests", 0) for c in window), default=0),
        "capped_429": sum(c.get("capped", 0) for c in window),
        "injected_faults": sum(c.get("faults", 0) for c in window),
    }


def memory_figures(rss: list[tuple[float, float]], skip_s: float) -> dict:
    t0 = rss[0][0]
    later = [(t - t0, m) for t, m in rss if t - t0 >= skip_s] or [(t - t0, m) for t, m in rss]
    n = len(later)
    mean_t = sum(t for t, _ in later) / n
    mean_m = sum(m for _, m in later) / n
    var = sum((t - mean_t) ** 2 for t, _ in later)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in later) / var if var else 0.0
    every, last = [], None
    for t, m in rss:  # one sample per 10 s, to see the shape
        if last is None or t - last >= 10:
            every.append([round(t - t0), round(m, 1)])
            last = t
    return {"rss_mb_start": round(rss[0][1], 1), "rss_mb_after_warmup": round(later[0][1], 1),
            "rss_mb_end": round(rss[-1][1], 1), "rss_mb_max": round(max(m for _, m in rss), 1),
            "rss_mb_per_min_after_warmup": round(slope * 60, 2), "warmup_s": skip_s, "samples": len(rss),
            "every_10s": every}


def cost_figures(wire: dict, objects: list[ObjectInfo], run: str, elapsed_s: float, versions: int, workers: int,
                 staleness: int, group_s: float) -> dict:
    """The R2 bill per hour from the counted requests and the bucket's bytes (R2Prices), beside what the
    operators' estimator (infra/ops/cost.estimate_cost) makes of the same bucket and hours."""
    p = R2Prices()
    modeled = wire.get("modeled", {})  # a real-size anchor upload's multipart requests (wire.py)
    billed = dict(wire["billed"])
    for k, v in modeled.items():
        billed[k] = billed.get(k, 0) + v
    hours = elapsed_s / 3600
    a = sum(v for k, v in billed.items() if k.split(" ")[1] in CLASS_A)
    b = sum(v for k, v in billed.items() if k.split(" ")[1] in CLASS_B)
    stored = sum(o.size for o in objects)
    usd_a, usd_b = a / 1e6 * p.class_a_usd_per_million / hours, b / 1e6 * p.class_b_usd_per_million / hours
    usd_storage = stored / GB * p.storage_usd_per_gb_month / HOURS_PER_MONTH
    growth_gb_per_hour = stored / GB / hours
    by_role = {role: {"class_a_per_hour": round(sum(v for k, v in billed.items() if k.startswith(role + " ")
                                                   and k.split(" ")[1] in CLASS_A) / hours),
                      "class_b_per_hour": round(sum(v for k, v in billed.items() if k.startswith(role + " ")
                                                   and k.split(" ")[1] in CLASS_B) / hours)}
               for role in ("learner", "worker")}
    est = estimate_cost(summarize_objects(run, objects, UsageAssumptions()), elapsed_s=elapsed_s, versions=versions,
                        workers=workers, staleness=staleness,
                        assumptions=UsageAssumptions(worker_poll_interval_s=group_s))
    return {
        "prices": p.model_dump(),
        "class_a_per_hour": round(a / hours), "class_b_per_hour": round(b / hours), "by_role": by_role,
        "modeled_per_hour": {k: round(v / hours) for k, v in modeled.items()},
        "usd_per_hour": {"class_a": round(usd_a, 4), "class_b": round(usd_b, 4),
                         "storage_now": round(usd_storage, 6), "total": round(usd_a + usd_b + usd_storage, 4)},
        "stored_bytes": stored, "stored_gb_growth_per_hour": round(growth_gb_per_hour, 4),
        "estimator": {"class_a_per_hour": round(est.class_a_per_hour), "class_b_per_hour": round(est.class_b_per_hour),
                      "usd_per_hour": round(est.usd_per_hour, 4)},
    }


def _pointer_at(publishes: list[dict], first: int = 1):
    """version(t): the newest version published by wall time t (the first anchor before any publish)."""
    import bisect

    pubs = sorted((p["t"], p["version"]) for p in publishes)
    times = [t for t, _ in pubs]
    best, running = [], first
    for _, v in pubs:
        running = max(running, v)
        best.append(running)

    def at(t: float) -> int:
        i = bisect.bisect_right(times, t)
        return best[i - 1] if i else first

    return at


def _held(worker: dict):
    """version(t) a worker held at wall time t (None: not joined, or crashed and not joined again)."""
    import bisect

    events = sorted([(j["t1"], j["version"]) for j in worker["joins"] if "version" in j]
                    + [(f["t1"], f["to"]) for f in worker.get("follows", [])]
                    + [(t, None) for t in worker.get("crash_t", [])], key=lambda e: e[0])
    times = [t for t, _ in events]

    def at(t: float) -> int | None:
        i = bisect.bisect_right(times, t)
        return events[i - 1][1] if i else None

    return at


def sync_figures(workers: list[dict], learner: dict, wire: dict, spec, t0: float, stop_wall: float,
                 every_s: float = 15.0) -> dict:
    """With a real fleet's sizes: the joins (the storm of a fleet starting at once), how far behind the pointer
    the followers are over time and when they upload, the time they spend downloading, and the egress."""
    pointer = _pointer_at(learner["publishes"])
    held = [_held(w) for w in workers]
    elapsed = stop_wall - t0
    rows = []
    t = t0
    while t <= stop_wall + 1e-6:
        behind = [pointer(t) - v for v in (h(t) for h in held) if v is not None]
        joining = sum(1 for w in workers if any(j["t0"] <= t < j["t1"] for j in w["joins"])
                      or (w.get("joining") is not None and w["joining"] <= t))
        rows.append({"t": round(t - t0), "pointer": pointer(t), "joined": len(behind), "joining": joining,
                     "behind_p50": pct(behind, 0.5), "behind_p90": pct(behind, 0.9),
                     "behind_max": max(behind, default=None)})
        t += every_s
    firsts = [next((j for j in w["joins"] if "version" in j), None) for w in workers]
    first_s = [j["t1"] - j["t0"] for j in firsts if j is not None]
    all_joins = [j for w in workers for j in w["joins"]]
    in_flight = [stop_wall - w["joining"] for w in workers if w.get("joining") is not None]
    follows = [f for w in workers for f in w.get("follows", [])]
    follow_s = [f["t1"] - f["t0"] for f in follows]
    patches = [f["to"] - f["from"] for f in follows]
    holding_s = 0.0  # worker-seconds holding weights, and of them in a follow
    for w, h in zip(workers, held, strict=True):
        marks = sorted({j["t1"] for j in w["joins"] if "version" in j} | set(w.get("crash_t", [])) | {stop_wall})
        prev = None
        for m in marks:
            if prev is not None and h(prev) is not None:
                holding_s += min(m, stop_wall) - prev
            prev = m
    following_s = sum(max(0.0, min(f["t1"], stop_wall) - f["t0"]) for f in follows)
    lags = [pointer(u["t"]) - u["version"] for w in workers for u in w["uploads"] if u["expect"] is None]
    hours = elapsed / 3600
    down = {k: v for k, v in wire["bytes_down"].items()}
    worker_down = sum(v for k, v in down.items() if k.startswith("worker "))
    worker_hours = sum(max(0.0, stop_wall - w["joins"][0]["t0"]) for w in workers if w["joins"]) / 3600
    per_s = wire.get("down_per_s", {})
    return {
        "sizes": {"anchor_bytes": spec.anchor_bytes, "anchor_shards": spec.anchor_shards,
                  "patch_bytes": spec.patch_bytes, "bandwidth_bps": spec.bandwidth_bps,
                  "anchor_s_at_bandwidth": round(spec.anchor_bytes / spec.bandwidth_bps, 2),
                  "patch_s_at_bandwidth": round(spec.patch_bytes / spec.bandwidth_bps, 3)},
        "joins": {"workers": len(workers), "first_joined": len(first_s),
                  "first_join_s": {"p50": pct(first_s, 0.5), "p99": pct(first_s, 0.99),
                                   "min": round(min(first_s), 2) if first_s else None,
                                   "max": round(max(first_s), 2) if first_s else None},
                  "joined_by_s": round(max((j["t1"] for j in firsts if j), default=t0) - t0, 1),
                  "attempts": len(all_joins), "failed_attempts": sum("error" in j for j in all_joins),
                  "in_flight_at_stop": len(in_flight),
                  "in_flight_s_max": round(max(in_flight), 1) if in_flight else None,
                  "sized_transfers_in_flight_peak": wire.get("sized_in_flight_peak")},
        "follows": {"n": len(follows), "s": {"p50": pct(follow_s, 0.5), "p99": pct(follow_s, 0.99)},
                    "patches": {"p50": pct(patches, 0.5), "p99": pct(patches, 0.99), "max": max(patches, default=None)},
                    "share_of_held_time": round(following_s / holding_s, 3) if holding_s else None},
        "upload_lag_versions": {"n": len(lags), "p50": pct(lags, 0.5), "p90": pct(lags, 0.9),
                                "max": max(lags, default=None),
                                "over_staleness": sum(x > spec.staleness for x in lags)},
        "lag_timeline": rows,
        "egress": {"worker_gb": round(worker_down / 1e9, 3),
                   "by_kind_gb": {k: round(v / 1e9, 4) for k, v in down.items() if v},
                   "gb_per_hour": round(sum(down.values()) / 1e9 / hours, 1),
                   "worker_gb_per_hour": round(worker_down / 1e9 / hours, 1),
                   "gb_per_worker_hour": round(worker_down / 1e9 / worker_hours, 2) if worker_hours else None,
                   "peak_gb_per_s": round(max(per_s.values(), default=0) / 1e9, 3),
                   "r2_usd": 0.0},
    }


def sized_problems(spec, wire: dict, objects: list[ObjectInfo], run: str, workers: list[dict],
                   publishes: list[dict]) -> list[str]:
    """Does the wire count the declared bytes, exactly, and did the sized objects take their time?"""
    from worker_contract.store.s3 import DEFAULT_PART_SIZE

    problems = []
    declared, count = wire["declared"], wire["sized_requests"]
    for key, size in (("worker GET patch", spec.patch_bytes), ("learner PUT patch", spec.patch_bytes)):
        if size and declared.get(key, 0) != count.get(key, 0) * size:
            problems.append(f"{key}: {declared.get(key, 0)} bytes counted for {count.get(key, 0)} patches of {size}")
    shard = spec.anchor_bytes / spec.anchor_shards
    for key in ("worker GET anchor", "learner PUT anchor"):
        n = count.get(key, 0)
        if spec.anchor_bytes and abs(declared.get(key, 0) - n * shard) > n:
            problems.append(f"{key}: {declared.get(key, 0)} bytes counted for {n} shards of {shard:.0f}")
    shards: dict[str, int] = {}
    for o in objects:
        if "/anchors/" in o.key and o.key.endswith(".safetensors"):
            shards[o.key.rsplit("/", 1)[0]] = shards.get(o.key.rsplit("/", 1)[0], 0) + 1
    if spec.anchor_bytes and any(n != spec.anchor_shards for n in shards.values()):
        problems.append(f"anchors in the bucket have {sorted(set(shards.values()))} shards, declared "
                        f"{spec.anchor_shards}")
    parts = -(-int(shard) // DEFAULT_PART_SIZE)
    if spec.anchor_bytes and shard > DEFAULT_PART_SIZE and \
            wire["modeled"].get("learner MPU_PART anchor", 0) != count.get("learner PUT anchor", 0) * parts:
        problems.append(f"multipart parts modeled {wire['modeled'].get('learner MPU_PART anchor', 0)}, expected "
                        f"{count.get('learner PUT anchor', 0)} shards x {parts}")
    floor = spec.anchor_bytes / spec.bandwidth_bps  # no join can read an anchor faster than the model allows
    fast = [j["t1"] - j["t0"] for w in workers for j in w["joins"] if "version" in j
            and j["t1"] - j["t0"] < floor]
    if spec.anchor_bytes and fast:
        problems.append(f"{len(fast)} joins read a {spec.anchor_bytes} byte anchor faster than "
                        f"{spec.bandwidth_bps:.0f} bytes/s allow (fastest {min(fast):.2f} s < {floor:.2f} s)")
    return problems
