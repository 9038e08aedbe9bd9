"""After a fleet run: is every uploaded group accounted for exactly once, and did any version name two states?

The bucket's final listing is the truth of what was uploaded (an upload whose answer was lost still
landed). Each record ends in exactly one fate: used, dropped:<reason>, pooled, unread_in_window (must be
none after the final drain) or late (never listed: the floor trainer/rollouts/source.py names). A hostile
record that was read must be dropped for exactly the reason it was built to trip; an honest one may only
be used, pooled, or age out (`stale`, `late`). The fates in full: docs/performance.md (module notes).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from worker_contract import layout

#: the reasons a well-formed record from an honest worker may be dropped for: it aged out
AGED = {"stale"}


def _version_of(key: str) -> int:
    try:
        return layout.parse_rollout_key(key).version
    except ValueError:
        parts = key.split("/")
        return int(parts[2][1:]) if len(parts) > 2 and parts[2][1:].isdigit() else 0


def account(bucket_keys: list[str], workers: list[dict], learner: dict, reuse_cap: int,
            learner_lists: dict[str, float]) -> dict:
    """Fates of every record, and the list of every violation (empty when the run is sound)."""
    problems: list[str] = []
    uploaded = set(bucket_keys)
    claimed: dict[str, dict] = {}
    kind_of: dict[str, str] = {}
    for w in workers:
        for u in w["uploads"]:
            claimed[u["key"]] = u
            kind_of[u["key"]] = w["kind"]
    lost = [k for k, u in claimed.items() if u["sure"] and k not in uploaded]
    if lost:
        problems.append(f"{len(lost)} uploads a worker saw succeed are not in the bucket, e.g. {lost[0]}")
    unclaimed = sorted(uploaded - claimed.keys())
    if unclaimed:
        problems.append(f"{len(unclaimed)} records in the bucket no worker uploaded, e.g. {unclaimed[0]}")

    uses = Counter()
    for key, use, _latency, _lag in learner["uses"]:
        uses[key] += 1
        if use != uses[key]:
            problems.append(f"{key} handed out as use {use} but it was use {uses[key]}")
    over = [k for k, n in uses.items() if n > reuse_cap]
    if over:
        problems.append(f"{len(over)} groups used more than the reuse cap {reuse_cap}, e.g. {over[0]}")
    dropped: dict[str, list[str]] = defaultdict(list)
    for key, reason in learner["journal"]:
        dropped[key].append(reason)
    twice = [k for k, rs in dropped.items() if len(rs) > 1]
    if twice:
        problems.append(f"{len(twice)} records dropped more than once, e.g. {twice[0]}: {dropped[twice[0]]}")
    both = sorted(uses.keys() & dropped.keys())
    if both:
        problems.append(f"{len(both)} records both used and dropped, e.g. {both[0]}: {dropped[both[0]]}")
    if Counter(r for rs in dropped.values() for r in rs) != Counter(learner["drops"]):
        problems.append(f"the drop journal {dict(Counter(r for rs in dropped.values() for r in rs))} disagrees "
                        f"with the source's counters {learner['drops']}")
    stray = sorted((uses.keys() | dropped.keys()) - uploaded)
    if stray:
        problems.append(f"{len(stray)} keys used or dropped that are not in the bucket, e.g. {stray[0]}")

    window = set(learner["window"])
    read = set(learner["read"])
    fates: dict[str, str] = {}
    for key in sorted(uploaded):
        if key in uses:
            fates[key] = "used"
        elif key in dropped:
            fates[key] = f"dropped:{dropped[key][0]}"
        elif key in read:
            fates[key] = "pooled"
            if _version_of(key) not in window:
                problems.append(f"{key} was read, neither used nor dropped, and is outside the window")
        elif _version_of(key) in window:
            fates[key] = "unread_in_window"
        else:
            fates[key] = "late"
            # late means it landed after its prefix's last (whole) listing; one that landed before was listed
            prefix = key.rsplit("/", 2)[0] + "/"
            done = claimed.get(key, {}).get("t_done")
            if done is not None and done < learner_lists.get(prefix, 0.0):
                problems.append(f"{key} landed before the learner last listed {prefix}, yet it was neither read "
                                "nor counted")
    used_once_in_window = sum(1 for k, n in uses.items() if n < reuse_cap and _version_of(k) in window)
    pooled = sum(f == "pooled" for f in fates.values())
    pool = int(learner["metrics"].get("rollout/pool", -1))
    if pool != pooled + used_once_in_window:
        problems.append(f"the source pools {pool} groups; the accounting finds {pooled} read and unused plus "
                        f"{used_once_in_window} used fewer than {reuse_cap} times inside the window")
    unread = [k for k, f in fates.items() if f == "unread_in_window"]
    if unread:
        problems.append(f"{len(unread)} records inside the window were never read after the final drain, "
                        f"e.g. {unread[0]}")
    for key, fate in fates.items():
        expect = claimed.get(key, {}).get("expect")
        reason = fate.split(":", 1)[1] if fate.startswith("dropped:") else None
        if expect is not None:
            if fate in ("used", "pooled"):
                problems.append(f"hostile record {key} ({expect}) was {fate}")
            elif reason is not None and reason != expect and not (reason in AGED and key not in read):
                problems.append(f"hostile record {key} built for {expect} was dropped as {reason}")
        elif reason is not None and reason not in AGED:
            problems.append(f"honest record {key} ({kind_of.get(key)}) was dropped as {reason}")

    by_kind: dict[str, Counter] = defaultdict(Counter)
    for key, fate in fates.items():
        by_kind[kind_of.get(key, "?")][fate if not fate.startswith("dropped:") or claimed.get(key, {}).get("expect")
                                      is None else "dropped:hostile:" + fate.split(":", 1)[1]] += 1
    ledger = {  # each count from its own witness, never from the fates: a lost or double-counted group differs
        "workers_landed": sum(1 for k, u in claimed.items() if u["sure"] or k in uploaded),
        "learner_used": len(uses),
        "learner_dropped": sum(learner["drops"].values()),
        "learner_pooled": pool - used_once_in_window,
    }
    caught = Counter(u["expect"] for k, u in claimed.items() if u.get("expect")
                     and fates.get(k) == f"dropped:{u['expect']}")
    out = {
        "records": len(uploaded),
        "ledger": ledger,
        "hostile_caught": dict(sorted(caught.items())),  # dropped for the reason built in (not aged out), by kind
        "fates": dict(Counter(fates.values())),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "uploads_unsure": sum(not u["sure"] for u in claimed.values()),
        "stale_never_read": sum(f == "dropped:stale" and k not in read for k, f in fates.items()),
        "problems": problems,
    }
    problems.extend(ledger_problems(out))
    out["exactly_once"] = not problems
    return out


def ledger_problems(acc: dict) -> list[str]:
    """Where the fates disagree with the counts their witnesses kept (empty when every group is counted once):
    the bucket against the workers' uploads, used / dropped / pooled against the learner's own counters."""
    fates, led = acc["fates"], acc["ledger"]
    dropped = sum(n for f, n in fates.items() if f.startswith("dropped:"))
    pairs = (("records in the bucket", acc["records"], "uploads the workers saw land", led["workers_landed"]),
             ("used", fates.get("used", 0), "groups the learner trained on", led["learner_used"]),
             ("dropped", dropped, "the source's drop counters", led["learner_dropped"]),
             ("pooled", fates.get("pooled", 0), "the source's pool less its unfinished uses", led["learner_pooled"]))
    return [f"{a} {x} != {b} {y}" for a, x, b, y in pairs if x != y]


def versions_check(workers: list[dict], publishes: list[dict], first: int) -> dict:
    """No version number named two states (across every worker's reconstruction), and every publish moved
    to a fresh, higher version."""
    problems: list[str] = []
    digests: dict[int, set[str]] = defaultdict(set)
    for w in workers:
        for v, d in w["reached"].items():
            digests[int(v)].add(d)
    reused = sorted(v for v, ds in digests.items() if len(ds) > 1)
    if reused:
        problems.append(f"versions named with two states: {reused[:10]}")
    seq = [first] + [p["version"] for p in publishes]
    if any(b <= a for a, b in zip(seq, seq[1:], strict=False)):
        problems.append(f"publishes did not move to fresh higher versions: {seq}")
    return {"versions_published": len(publishes) + 1, "newest": seq[-1], "versions_reached_by_workers": len(digests),
            "problems": problems}
