"""`python -m bench.fleet [--scale 16,64,256] [--storm 64] [--compare OPT=BEFORE,AFTER] [--sizes real] ...`

Runs the fleet once per scale point (the last point carries the cold-join storm), optionally twice more
at `--compare-workers` with a rollout-source option set to its before and after values, and writes every
run's figures, a summary table and the machine and commit to `--out` (default bench/results/fleet.json).
`--sizes real` (or `--anchor-bytes`, `--patch-bytes`) declares anchors and patches a real fleet's size on
the wire (bench/fleet/spec.py REAL_ANCHOR_BYTES): joins, followers' lag and egress at those sizes.
Exit 1 when any run fails its accounting, its bucket check or its version check; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import RESULTS, write_result
from worker_contract.cli import number

from .spec import REAL_ANCHOR_BYTES, REAL_PATCH_BYTES, FleetSpec


def _ints(text: str) -> list[int]:
    """Comma-separated worker counts, each checked by worker_contract.cli.number."""
    count = number(int, at_least=1, hint="a worker count")
    out = [count(x.strip()) for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of worker counts")
    return out


def _bytes(text: str) -> int:
    """A byte count, written as an integer or in e-notation (3e9): worker_contract.cli.number's check, then whole."""
    n = number(float, at_least=0, hint="a byte count, e.g. 3e9")(text)
    if n != int(n):
        raise argparse.ArgumentTypeError(f"{text!r}: a byte count is a whole number, at least 0")
    return int(n)


def _compare(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    parts = values.split(",")
    if not name or len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not OPTION=BEFORE,AFTER (e.g. read_threads=1,16)")
    return name, [json.loads(p) for p in parts]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = FleetSpec()
    p.add_argument("--scale", type=_ints, default=[d.workers], help="worker counts to run, e.g. 16,64,256")
    p.add_argument("--duration", type=number(float, above=0), default=d.duration_s, help="seconds each run's fleet works")
    p.add_argument("--group-s", type=number(float, above=0), default=d.group_s, help="mean seconds per group of an honest worker")
    p.add_argument("--step-s", type=number(float, above=0), default=d.step_s, help="the learner's compute per step")
    p.add_argument("--storm", type=number(int, at_least=0), default=0, help="workers joining at once in the last scale run")
    p.add_argument("--storm-at", type=number(float, at_least=0), default=d.storm_at_s, help="seconds into the run the storm starts")
    p.add_argument("--compare", type=_compare, default=None, help="OPTION=BEFORE,AFTER of the rollout source")
    p.add_argument("--compare-workers", type=number(int, at_least=1), default=None, help="fleet size of the comparison (default: "
                   "the largest scale point, whose run is then the 'after' one)")
    p.add_argument("--staleness", type=number(int, at_least=1), default=d.staleness, help="the run's staleness bound in versions")
    p.add_argument("--worker-procs", type=number(int, at_least=1), default=d.worker_procs, help="processes the workers run in")
    p.add_argument("--sizes", choices=("real",), default=None, help="anchors and patches declared a real fleet's "
                   f"size: {REAL_ANCHOR_BYTES} and {REAL_PATCH_BYTES} bytes (bench/results/pulse_gpu.json)")
    p.add_argument("--anchor-bytes", type=_bytes, default=None, help="declared bytes of an anchor, e.g. 3e9")
    p.add_argument("--patch-bytes", type=_bytes, default=None, help="declared bytes of a patch, e.g. 18e6")
    p.add_argument("--bandwidth-mbit", type=number(float, above=0), default=d.bandwidth_bps * 8 / 1e6,
                   help="the proxy's transfer rate per connection, Mbit/s")
    p.add_argument("--ramp", type=number(float, at_least=0), default=d.ramp_s, help="seconds over which the workers' first joins spread")
    p.add_argument("--seed", type=number(int, at_least=0), default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "fleet.json")
    return p


def summary(r: dict) -> dict:
    t, lf, w, c = r["throughput"], r["learner"], r["workers"], r["cost"]
    return {"label": r["spec"]["label"], "workers": r["spec"]["workers"], "batch": r["batch"], "steps": t["steps"],
            "ingested_per_s": t["groups_ingested_per_s"], "ingested_per_step": t["groups_ingested_per_step"],
            "fresh_per_step": t["fresh_groups_per_step"], "poll_s_p50": lf["poll_s"]["p50"],
            "poll_s_p99": lf["poll_s"]["p99"], "poll_busy_frac": lf["poll_busy_frac"],
            "learner_requests_per_step": lf["requests_per_step"],
            "pointer_polls_per_worker_hour": w["pointer_polls_per_worker_hour"],
            "anchor_requests_per_worker_hour": w["anchor_requests_per_worker_hour"],
            "upload_to_use_p50_s": t["upload_to_use_s"]["p50"], "upload_to_use_p99_s": t["upload_to_use_s"]["p99"],
            "stale_drops": t["drops"].get("stale", 0), "fates": r["accounting"]["fates"],
            "usd_per_hour": c["usd_per_hour"]["total"], "rss_mb_per_min": r["memory"]["rss_mb_per_min_after_warmup"],
            "class_a_per_hour": c["class_a_per_hour"], "class_b_per_hour": c["class_b_per_hour"],
            **(_sync_summary(r["sync"]) if "sync" in r else {}), "ok": r["ok"]}


def _sync_summary(s: dict) -> dict:
    j, f, e, lag = s["joins"], s["follows"], s["egress"], s["upload_lag_versions"]
    return {"first_join_s_p50": j["first_join_s"]["p50"], "first_join_s_max": j["first_join_s"]["max"],
            "first_joined": j["first_joined"], "joins_in_flight_at_stop": j["in_flight_at_stop"],
            "follow_s_p50": f["s"]["p50"], "patches_per_follow_p50": f["patches"]["p50"],
            "following_share": f["share_of_held_time"], "upload_lag_p50": lag["p50"], "upload_lag_p90": lag["p90"],
            "uploads_over_staleness": lag["over_staleness"], "uploads": lag["n"],
            "egress_gb_per_hour": e["gb_per_hour"], "egress_gb_per_worker_hour": e["gb_per_worker_hour"],
            "egress_peak_gb_per_s": e["peak_gb_per_s"]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    anchor = args.anchor_bytes if args.anchor_bytes is not None else REAL_ANCHOR_BYTES if args.sizes else 0
    patch = args.patch_bytes if args.patch_bytes is not None else REAL_PATCH_BYTES if args.sizes else 0
    if args.bandwidth_mbit <= 0 or args.ramp < 0 or args.staleness < 1:
        print("--bandwidth-mbit must be above 0, --ramp at least 0 and --staleness at least 1", file=sys.stderr)
        return 2
    base = FleetSpec(duration_s=args.duration, group_s=args.group_s, step_s=args.step_s, seed=args.seed,
                     worker_procs=args.worker_procs, storm_at_s=args.storm_at, anchor_bytes=anchor,
                     patch_bytes=patch, bandwidth_bps=args.bandwidth_mbit * 1e6 / 8, ramp_s=args.ramp,
                     staleness=args.staleness)
    if args.storm and args.storm_at >= args.duration:
        print(f"--storm-at {args.storm_at:g} must be inside the run (--duration {args.duration:g})", file=sys.stderr)
        return 2
    plan: list[FleetSpec] = []
    for i, n in enumerate(args.scale):
        last = i == len(args.scale) - 1
        plan.append(base.with_(workers=n, storm=args.storm if last else 0, label=f"scale-{n}"))
    if args.compare:
        name, (before, after) = args.compare
        n = args.compare_workers or max(args.scale)
        plan = [s.with_(source_options={name: after}) for s in plan]
        if args.compare_workers is None:  # the largest scale run is the 'after'; add the 'before' beside it
            plan.append(base.with_(workers=n, label=f"before-{n}", source_options={name: before}))
        else:
            plan += [base.with_(workers=n, label=f"before-{n}", source_options={name: before}),
                     base.with_(workers=n, label=f"after-{n}", source_options={name: after})]
    runs = []
    t0 = time.monotonic()
    for spec in plan:
        r = _run(spec)
        runs.append(r)
        s = summary(r)
        print(f"  -> {s['label']}: {json.dumps({k: v for k, v in s.items() if k != 'label'})}", flush=True)
    result = {"runs": runs, "summary": [summary(r) for r in runs], "wall_s": round(time.monotonic() - t0, 1),
              "ok": all(r["ok"] for r in runs)}
    if args.compare:
        result["compare"] = {"option": args.compare[0], "before": args.compare[1][0], "after": args.compare[1][1]}
    out = write_result("fleet", result, args.out, argv=argv, module="bench.fleet")
    print(f"fleet figures written to {out}")
    for r in runs:
        for problem in r["accounting"]["problems"] + r["versions"]["problems"] + r.get("sized_problems", []):
            print(f"{r['spec']['label']}: {problem}", file=sys.stderr)
        if not r["bucket_verifies"]:
            print(f"{r['spec']['label']}: the bucket does not verify: {r['verify_tail']}", file=sys.stderr)
    return 0 if result["ok"] else 1


def _run(spec: FleetSpec) -> dict:
    from .run import run_fleet

    return run_fleet(spec, say=lambda line: print(line, flush=True))
