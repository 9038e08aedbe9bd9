"""One fleet run, end to end: start the bucket and the wire, the learner, then the workers in a few
processes (and a cold-join storm if asked); stop them after `duration_s`, let the learner drain, then
account for every record, verify the bucket and compute the figures. Every process started here is
stopped here, by PID."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from collections.abc import Callable

import boto3

from worker_contract import layout
from worker_contract.store import ObjectInfo
from worker_contract.store.s3 import S3Store
from worker_contract.verify import verify_run

from . import figures
from .accounting import account, versions_check
from .learner import learner_process
from .spec import FleetSpec
from .wire import BUCKET, SECRET, FleetSizes, MotoProcess, WireStats, start_proxy, store_env
from .workers import worker_process

DIRECT_KEY = "AKIAFLEETDIRECT00001"  # the verifier's reads go straight to the server: not counted


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts) if items[i::parts]]


def run_fleet(spec: FleetSpec, say: Callable[[str], None] = print) -> dict:
    run = f"fleet-{spec.label or 'run'}-{spec.workers}-{int(time.time())}"
    moto = MotoProcess()
    procs: list = []
    proxy = None
    try:
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1", aws_access_key_id=DIRECT_KEY,
                     aws_secret_access_key=SECRET).create_bucket(Bucket=BUCKET)
        stats = WireStats(run)
        proxy = start_proxy(spec, moto.endpoint, stats)
        ctx = mp.get_context("spawn")
        results, ready, learner_stop, fleet_stop = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
        learner = ctx.Process(target=learner_process, args=(spec, run, proxy.url, learner_stop, ready, results),
                              name="fleet-learner")
        learner.start()
        procs.append(learner)
        if not ready.wait(180):
            raise RuntimeError("the learner did not publish v1 within 180 s")
        rng = random.Random(spec.seed)
        kinds = spec.kinds()
        offsets = [rng.uniform(0, spec.ramp_s) for _ in range(spec.workers)]
        go, go_time = ctx.Event(), ctx.Value("d", 0.0)
        common = (spec, run, proxy.url, go, go_time, fleet_stop, results)
        expected = 0
        for part in _split(list(range(spec.workers)), spec.worker_procs):
            procs.append(_start_workers(ctx, part, [kinds[i] for i in part], [offsets[i] for i in part], common))
            expected += 1
        storm_ids = list(range(spec.workers, spec.workers + spec.storm))
        for part in _split(storm_ids, max(1, spec.worker_procs // 2)):
            procs.append(_start_workers(ctx, part, ["honest"] * len(part), [spec.storm_at_s] * len(part), common))
            expected += 1
        _wait_ready(results, expected, procs)
        t0 = go_time.value = time.time()
        go.set()
        stop_at = t0 + spec.duration_s
        say(f"fleet {spec.label or ''} {spec.workers} workers (+{spec.storm} storm), {spec.duration_s:.0f} s, "
            f"run {run}")
        while time.time() < stop_at:
            time.sleep(min(10.0, max(0.0, stop_at - time.time())))
            snap = stats.snapshot()["billed"]
            say(f"  t={time.time() - t0:5.0f} s  requests {sum(snap.values()):6d}  uploads "
                f"{figures._sum(snap, 'worker', 'PUT', 'rollout'):5d}  learner reads "
                f"{figures._sum(snap, 'learner', 'GET', 'rollout'):5d}")
        fleet_stop.set()
        reports: list[dict] = []
        learner_res = None
        deadline = time.time() + 300
        got = 0
        while got < expected and time.time() < deadline:
            try:
                tag, payload = results.get(timeout=5)
            except queue.Empty:
                continue
            if tag == "workers":
                reports.extend(payload)
                got += 1
            else:
                learner_res = payload
        stop_wall = time.time()
        learner_stop.set()
        while learner_res is None and time.time() < deadline:
            try:
                tag, payload = results.get(timeout=5)
            except queue.Empty:
                if not learner.is_alive():
                    break
                continue
            if tag == "learner":
                learner_res = payload
        if learner_res is None or got < expected:
            raise RuntimeError(f"the fleet did not report back (learner {'ok' if learner_res else 'missing'}, "
                               f"{got}/{expected} worker processes)")
        wire = stats.snapshot()
        proxy.stop()
        proxy = None
        direct = S3Store.from_url(f"s3://{BUCKET}", store_env(moto.endpoint, DIRECT_KEY))
        say("  verifying the bucket and accounting for every record")
        return _figures(spec, run, direct, reports, learner_res, wire, t0, stop_wall, set(storm_ids))
    finally:
        if proxy is not None:
            proxy.stop()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        moto.stop()


def _start_workers(ctx, part, kinds, offsets, common):
    p = ctx.Process(target=worker_process, args=(part, kinds, offsets, *common), name=f"fleet-workers-{part[0]}")
    p.start()
    return p


def _wait_ready(results, expected: int, procs: list) -> None:
    """Every worker process has imported what it needs (on a loaded machine that takes tens of seconds)."""
    ready, deadline = 0, time.time() + 300
    while ready < expected:
        if time.time() > deadline or any(not p.is_alive() for p in procs):
            raise RuntimeError(f"only {ready}/{expected} worker processes started")
        try:
            tag, _ = results.get(timeout=5)
        except queue.Empty:
            continue
        ready += tag == "ready"


def _figures(spec: FleetSpec, run: str, direct: S3Store, reports: list[dict], learner: dict, wire: dict,
             t0: float, stop_wall: float, storm_ids: set[int]) -> dict:
    objects = list(direct.list(layout.run_prefix(run)))
    rollout_keys = [o.key for o in objects if o.key.startswith(layout.rollouts_prefix(run))]
    lines: list[str] = []
    verified = verify_run(direct, run, out=lines.append)
    accounting = account(rollout_keys, reports, learner, spec.reuse_cap, wire["learner_lists"])
    versions = versions_check(reports, learner["publishes"], 1)
    elapsed = stop_wall - t0
    storm = [r for r in reports if int(r["worker"][1:]) in storm_ids]
    fleet = [r for r in reports if int(r["worker"][1:]) not in storm_ids]
    billed_objects = objects
    if spec.sized:  # the bucket holds what a real fleet's would: each sized object at its declared size
        sizes = FleetSizes(spec, run)
        billed_objects = [ObjectInfo(key=o.key, size=sizes.of(o.key) or o.size, etag=o.etag) for o in objects]
    out = {
        "spec": spec.to_json(), "run": run, "elapsed_s": round(elapsed, 1), "batch": spec.batch,
        "throughput": figures.throughput(learner, elapsed),
        "learner": figures.learner_figures(learner, wire, elapsed),
        "workers": figures.worker_figures(fleet, wire, stop_wall),
        "storm": figures.storm_figures(storm, wire, wire["wall0"]),
        "memory": figures.memory_figures(learner["rss"], skip_s=elapsed / 2),
        "cost": figures.cost_figures(wire, billed_objects, run, elapsed, versions["newest"], spec.workers + spec.storm,
                                     spec.staleness, spec.group_s),
        "wire": {"faults": wire["faults"], "statuses": wire["statuses"],
                 "requests": sum(wire["billed"].values()), "billed": wire["billed"], "bytes_down": wire["bytes_down"],
                 "bytes_up": wire["bytes_up"], "declared": wire["declared"], "sized_requests": wire["sized_requests"],
                 "modeled": wire["modeled"]},
        "accounting": accounting,
        "versions": versions,
        "bucket_verifies": bool(verified),
        "verify_tail": lines[-3:],
    }
    if spec.sized:
        out["sync"] = figures.sync_figures(reports, learner, wire, spec, t0, stop_wall)
        out["sized_problems"] = figures.sized_problems(spec, wire, objects, run, reports, learner["publishes"])
    out["ok"] = (accounting["exactly_once"] and not versions["problems"] and out["bucket_verifies"]
                 and not out.get("sized_problems"))
    return out

