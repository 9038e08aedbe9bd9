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
    billed = wire["billed"]
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
        "usd_per_hour": {"class_a": round(usd_a, 4), "class_b": round(usd_b, 4),
                         "storage_now": round(usd_storage, 6), "total": round(usd_a + usd_b + usd_storage, 4)},
        "stored_bytes": stored, "stored_gb_growth_per_hour": round(growth_gb_per_hour, 4),
        "estimator": {"class_a_per_hour": round(est.class_a_per_hour), "class_b_per_hour": round(est.class_b_per_hour),
                      "usd_per_hour": round(est.usd_per_hour, 4)},
    }
