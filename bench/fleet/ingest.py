"""`python -m bench.fleet.ingest`: the learner's ingest ceiling, groups a second the real rollout source
takes in when the fleet supplies more than it can take: a backlog from `--workers` identities in moto,
drained by fresh sources through the fault proxy's R2-like latency (optionally with `--live-rps` more
arriving), each poll split into listing, waiting for reads and judging; `--compare` drains the same
backlog with each value of one source option, interleaved (`reader=chunked,window`: the reads before and
after the sliding window). What it measures and found: docs/performance.md, "The learner's ingest ceiling".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import RESULTS, write_result
from worker_contract.cli import number

from .spec import FleetSpec

DIRECT_KEY = "AKIAFLEETDIRECT00001"


def _timed_source_class(reader: str):
    from functools import partial

    from trainer.rollouts.source import READ_AHEAD_BYTES, RolloutSource

    class ChunkedReads(RolloutSource):
        """The source with its reads as they were before the sliding window (trainer/rollouts/source.py at
        d56a080): a chunk of `read_threads` records fetched at once, judged, then the next chunk, so every
        chunk waits for its slowest read. Only `_reads` differs: the 'before' of the comparison."""

        def _reads(self, infos):
            if self.read_threads == 1:
                yield from ((info, partial(self.store.get, info.key)) for info in infos)
                return
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="rollout-read")
            chunk, size = [], 0
            for info in [*infos, None]:
                n = info.size if info is not None and self._fetchable(info) else 0
                if chunk and (info is None or len(chunk) >= self.read_threads or size + n > READ_AHEAD_BYTES):
                    futures = [self._readers.submit(self.store.get, i.key) if self._fetchable(i) else None
                               for i in chunk]
                    for i, f in zip(chunk, futures, strict=True):
                        yield i, f.result if f is not None else partial(self.store.get, i.key)
                    chunk, size = [], 0
                if info is not None:
                    chunk.append(info)
                    size += n

    base = {"chunked": ChunkedReads, "window": RolloutSource}[reader]

    class PhaseTimedSource(base):
        """The real source; wall time inside listing, waiting for a record's bytes, and judging is summed."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.phase = {"list_s": 0.0, "read_wait_s": 0.0, "judge_s": 0.0}
            self.gets = 0

        def _list_counted(self, prefix, start_after=None):
            t0 = time.perf_counter()
            try:
                return super()._list_counted(prefix, start_after)
            finally:
                self.phase["list_s"] += time.perf_counter() - t0

        def _ingest(self, info, prefix, current, read):
            waited = [0.0]

            def timed_read():
                t = time.perf_counter()
                try:
                    return read()
                finally:
                    waited[0] += time.perf_counter() - t
                    self.gets += 1

            t0 = time.perf_counter()
            try:
                return super()._ingest(info, prefix, current, timed_read)
            finally:
                self.phase["read_wait_s"] += waited[0]
                self.phase["judge_s"] += time.perf_counter() - t0 - waited[0]

    return PhaseTimedSource


def _fill(spec: FleetSpec, run: str, endpoint: str, backlog: int, current: int, threads: int) -> float:
    """`backlog` good records from `spec.workers` identities over the window's versions, straight to the server."""
    import random

    from worker_contract.store.s3 import S3Store

    from .wire import BUCKET, store_env
    from .workers import SimWorker

    t0 = time.monotonic()
    versions = list(range(max(1, current - spec.staleness), current + 1))
    store = S3Store.from_url(f"s3://{BUCKET}", store_env(endpoint, DIRECT_KEY))
    sims = [SimWorker(i, "honest", spec, run, endpoint, None, threading.Lock(), threading.Event(), 0.0)
            for i in range(spec.workers)]
    rng = random.Random(spec.seed)

    def one(n: int) -> None:
        w = sims[n % len(sims)]
        key, blob = w._good(versions[rng.randrange(len(versions))], f"g{n:013d}-{n * 2654435761 % 2**32:08x}")
        store.put(key, blob)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(backlog)))
    return time.monotonic() - t0


def live_supply(spec: FleetSpec, run: str, proxy_url: str, rps: float, current: int, start_n: int, stop,
                landed) -> None:
    """A process of the fleet that keeps uploading while the learner drains: `rps` records a second through
    the proxy, round-robin over the first 32 workers' identities (each its own client), until `stop`;
    `landed` counts the uploads that landed."""
    import boto3

    from worker_contract.store.s3 import S3Store

    from .wire import BUCKET, store_env, worker_key
    from .workers import SimWorker

    session = boto3.session.Session()
    n_ids = min(spec.workers, 32)
    stores = [S3Store.from_url(f"s3://{BUCKET}", store_env(proxy_url, worker_key(i)), session=session)
              for i in range(n_ids)]
    sims = [SimWorker(i, "honest", spec, run, proxy_url, None, threading.Lock(), threading.Event(), 0.0)
            for i in range(n_ids)]

    def put(store, key, blob) -> None:
        try:
            store.put_if_absent(key, blob)
        except Exception:  # a fault the client's retries did not absorb: one record fewer, not an error
            return
        with landed.get_lock():
            landed.value += 1

    t0, n = time.monotonic(), 0
    with ThreadPoolExecutor(8) as pool:
        while not stop.is_set():
            while n < (time.monotonic() - t0) * rps:
                k = start_n + n
                key, blob = sims[k % n_ids]._good(current, f"g{k:013d}-{k * 2654435761 % 2**32:08x}")
                pool.submit(put, stores[k % n_ids], key, blob)
                n += 1
            stop.wait(0.05)


def drain(spec: FleetSpec, run: str, manifest, proxy_url: str, options: dict, current: int, expect: int,
          limit_s: float) -> dict:
    """One fresh source polling back to back until `expect` records (the backlog) plus what arrived live are
    handled; records accepted a second over the drain."""
    from trainer.config import AlgoConfig
    from worker_contract.store.s3 import S3Store

    from .wire import BUCKET, LEARNER_KEY, store_env

    store = S3Store.from_url(f"s3://{BUCKET}", store_env(proxy_url, LEARNER_KEY))
    algo = AlgoConfig(staleness=spec.staleness, reuse_cap=spec.reuse_cap, groups_per_step=spec.batch,
                      max_new_tokens=spec.max_new_tokens, temperature=1.0)
    options = dict(options)
    reader = options.pop("reader", "window")
    source = _timed_source_class(reader).from_manifest(store, manifest, algo, **options)
    options = {"reader": reader, **options}
    cpu0, t0 = os.times(), time.monotonic()
    polls, first_full = [], None
    while time.monotonic() - t0 < limit_s:
        p0 = time.monotonic()
        added = source.poll(current)
        polls.append((round(time.monotonic() - p0, 4), added))
        handled = source.accepted + sum(source.drops.values())
        if handled >= expect and first_full is None:
            first_full = time.monotonic() - t0
            break
    wall = time.monotonic() - t0
    cpu1 = os.times()
    handled = source.accepted + sum(source.drops.values())
    return {
        "options": options, "wall_s": round(wall, 3), "accepted": source.accepted, "handled": handled,
        "expected_backlog": expect, "complete": first_full is not None,
        "groups_per_s": round(source.accepted / wall, 2), "drops": dict(source.drops),
        "polls": len(polls), "poll_s_max": max((p[0] for p in polls), default=0.0),
        "list_calls": source.list_calls, "gets": source.gets,
        "phase_s": {k: round(v, 3) for k, v in source.phase.items()},
        "phase_share": {k: round(v / wall, 3) for k, v in source.phase.items()},
        "process_cpu_s": round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), 2),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet.ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=number(int, at_least=1), default=256, help="worker identities the backlog comes from")
    p.add_argument("--backlog", type=number(int, at_least=1), default=2000, help="records in the bucket before the learner starts")
    p.add_argument("--live-rps", type=number(float, at_least=0), default=0.0, help="records a second arriving during each drain")
    p.add_argument("--compare", default="reader=chunked,window",
                   help="OPTION=A,B[,...]: a RolloutSource option, each value drained in turn (JSON or bare "
                   "words); 'reader' picks the reads: chunked (before the sliding window) or window (today's)")
    p.add_argument("--trials", type=number(int, at_least=1), default=2, help="rounds of the comparison (values interleaved)")
    p.add_argument("--limit", type=number(float, above=0), default=300.0, help="seconds a drain may take at most")
    p.add_argument("--fault-rate", type=number(float, at_least=0, at_most=1), default=FleetSpec().fault_rate)
    p.add_argument("--seed", type=number(int, at_least=0), default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "fleet_ingest.json")
    return p


def _values(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    if not name or not values:
        raise ValueError(f"--compare {text!r} is not OPTION=A,B (e.g. reader=chunked,window)")
    out = []
    for v in values.split(","):
        try:
            out.append(json.loads(v))
        except ValueError:
            out.append(v)
    return name, out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        name, values = _values(args.compare)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if name == "reader" and not set(values) <= {"chunked", "window"}:
        print(f"--compare reader= takes chunked and window, not {values}", file=sys.stderr)
        return 2
    if args.workers < 1 or args.backlog < 1 or args.trials < 1 or args.live_rps < 0:
        print("--workers, --backlog and --trials must be at least 1 and --live-rps at least 0", file=sys.stderr)
        return 2
    import boto3

    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import generate_private_key
    from worker_contract.store.s3 import S3Store

    from .learner import manifest_for
    from .wire import BUCKET, SECRET, MotoProcess, WireStats, start_proxy, store_env

    spec = FleetSpec(workers=args.workers, fault_rate=args.fault_rate, seed=args.seed, label="ingest")
    run = f"fleet-ingest-{args.workers}-{int(time.time())}"
    load_before = [round(x, 2) for x in os.getloadavg()]
    current = 8
    moto = MotoProcess()
    proxy = None
    try:
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1", aws_access_key_id=DIRECT_KEY,
                     aws_secret_access_key=SECRET).create_bucket(Bucket=BUCKET)
        direct = S3Store.from_url(f"s3://{BUCKET}", store_env(moto.endpoint, DIRECT_KEY))
        manifest = create_or_resume(direct, manifest_for(spec, run, generate_private_key()), resume=False)
        fill_s = _fill(spec, run, moto.endpoint, args.backlog, current, threads=8)
        print(f"backlog: {args.backlog} records from {args.workers} workers in {fill_s:.1f} s", flush=True)
        stats = WireStats(run)
        proxy = start_proxy(spec, moto.endpoint, stats)
        drains, expect, n_live = [], args.backlog, args.backlog
        ctx = mp.get_context("spawn")
        for trial in range(args.trials):
            for value in values:
                live = None
                if args.live_rps:
                    stop, landed = ctx.Event(), ctx.Value("i", 0)
                    live = ctx.Process(target=live_supply, args=(spec, run, proxy.url, args.live_rps, current,
                                                                 n_live, stop, landed), name="fleet-live")
                    live.start()
                before = stats.snapshot()
                d = drain(spec, run, manifest, proxy.url, {name: value}, current, expect, args.limit)
                after = stats.snapshot()
                if live is not None:
                    stop.set()
                    live.join(timeout=60)
                    if live.is_alive():
                        live.kill()
                        live.join(timeout=10)
                    d["live_landed"] = landed.value
                    n_live += int(args.live_rps * 10_000)  # fresh group ids for the next drain's uploads
                    expect += landed.value  # the next drain takes these in too
                d["trial"] = trial
                d["learner_requests"] = {k: after["billed"].get(k, 0) - before["billed"].get(k, 0)
                                         for k in after["billed"] if k.startswith("learner ")}
                d["learner_faults"] = {k: after["faults"].get(k, 0) - before["faults"].get(k, 0)
                                       for k in after["faults"] if k.startswith("learner ")}
                d["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
                drains.append(d)
                print(f"  trial {trial} {name}={value}: {d['groups_per_s']} groups/s ({d['accepted']} in "
                      f"{d['wall_s']} s, complete {d['complete']}), phases {d['phase_s']}, "
                      f"cpu {d['process_cpu_s']} s", flush=True)
        proxy.stop()
        proxy = None
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()
    summary = {}
    for value in values:
        rates = [d["groups_per_s"] for d in drains if d["options"][name] == value]
        summary[json.dumps(value)] = {"groups_per_s": rates, "mean": round(sum(rates) / len(rates), 2)}
    result = {"load_avg_before": load_before, "spec": spec.to_json(), "backlog": args.backlog,
              "live_rps": args.live_rps, "fill_s": round(fill_s, 1),
              "compare": {"option": name, "values": values}, "summary": summary, "drains": drains,
              "ok": all(d["complete"] for d in drains)}
    out = write_result("fleet_ingest", result, args.out, argv=argv, module="bench.fleet.ingest")
    print(f"ingest figures written to {out}: {json.dumps(summary)}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
