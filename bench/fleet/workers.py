"""Simulated rollout workers: the real contract (worker_contract's store client, reconstructor, record
schema and keys) with the model's sampling replaced by a sleep, hundreds as threads in a few processes.

Each worker has its own S3 client and access key (one boto3 session per process is shared: it only holds
the service model). Like the reference worker (worker_contract/worker/loop.py) it cold-joins from the
newest anchor at or below the pointer, follows the pointer between groups (never inside one), and uploads
one create-only record per group. Kinds (bench/fleet/spec.py KINDS) make some slow, stale, crashing or
hostile. Every upload that landed, every join and every (version, digest) a worker reached is reported.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from worker_contract import layout
from worker_contract.reconstruct import Reconstructor, SyncError
from worker_contract.schema import RolloutRecord, Sample, SamplingParams, encode_record
from worker_contract.store import PreconditionFailed, StoreError
from worker_contract.store.s3 import S3Store

from .spec import FleetSpec
from .wire import BUCKET, store_env, worker_key

log = logging.getLogger("bench.fleet.worker")
#: the bad records a hostile worker sends, each with the reason the learner must drop it for
HOSTILE = ("wrong_plane", "group_size", "future_version", "malformed", "vocab", "logprob_positive", "bad_key",
           "key_mismatch")


@dataclass
class WorkerReport:
    worker: str
    kind: str
    uploads: list[dict] = field(default_factory=list)
    """Every object that landed: key, expected drop reason (None for a good record), wall time, version."""
    joins: list[dict] = field(default_factory=list)
    """Every cold join: start and end wall time, the version and anchor it reached, or the error."""
    reached: dict[int, str] = field(default_factory=dict)
    """version -> state digest of every version this worker held (no version may name two states)."""
    follows: list[dict] = field(default_factory=list)
    """Every follow that moved: start and end wall time, the version before and after."""
    crash_t: list[float] = field(default_factory=list)
    joining: float | None = None
    """Wall time the join in progress started (None: none in progress)."""
    """Wall time of every crash (the worker holds no weights until it joins again)."""
    upload_failures: int = 0
    follow_failures: int = 0
    crashes: int = 0


class SimWorker:
    def __init__(self, index: int, kind: str, spec: FleetSpec, run: str, endpoint: str, session,
                 session_lock: threading.Lock, stop: threading.Event, start_at: float):
        self.index, self.kind, self.spec, self.run = index, kind, spec, run
        self.endpoint, self.session, self.session_lock = endpoint, session, session_lock
        self.stop, self.start_at = stop, start_at
        self.id = f"w{index:05d}"
        self.rng = random.Random(spec.seed * 100_003 + index)
        self.report = WorkerReport(self.id, kind)
        self.hostile_turn = 0
        self.uploading = False

    # -- the life of a worker ----------------------------------------------------------------------------
    def run_forever(self) -> None:
        if self.stop.wait(max(0.0, self.start_at - time.time())):
            return
        while not self.stop.is_set():
            rec = self._join()
            if rec is None:
                if self.stop.wait(self.rng.uniform(1.0, 3.0)):
                    return
                continue
            if not self._work(rec):
                return
            self.report.crashes += 1  # crashed: everything in memory is gone; restart after a pause
            self.report.crash_t.append(time.time())
            if self.stop.wait(self.rng.uniform(*self.spec.restart_s)):
                return

    def _store(self) -> S3Store:
        with self.session_lock:  # a boto3 session is not thread-safe; its clients are
            return S3Store.from_url(f"s3://{BUCKET}", store_env(self.endpoint, worker_key(self.index)),
                                    session=self.session, max_concurrency=2)

    def _join(self) -> Reconstructor | None:
        t0 = self.report.joining = time.time()
        try:
            rec = Reconstructor(self._store(), self.run, plane="bf16", n_samples=self.spec.n_samples)
            version, _ = rec.join()
        except (SyncError, StoreError) as e:  # a flaky store or a publish in flight: try again
            self.report.joins.append({"t0": t0, "t1": time.time(), "error": str(e)[:200]})
            return None
        finally:
            self.report.joining = None
        self.report.joins.append({"t0": t0, "t1": time.time(), "version": version})
        self.report.reached[version] = rec.digest
        return rec

    def _work(self, rec: Reconstructor) -> bool:
        """Groups until stopped (False) or crashed (True)."""
        factor = self.spec.slow_factor if self.kind == "slow" else 1.0
        while not self.stop.is_set():
            if self.kind != "stale":
                t0, before = time.time(), rec.version
                try:
                    if rec.follow() is not None:
                        self.report.reached[rec.version] = rec.digest
                        self.report.follows.append({"t0": t0, "t1": time.time(), "from": before, "to": rec.version})
                except (SyncError, StoreError):
                    self.report.follow_failures += 1  # stay on the last good version, as the real worker
            seconds = self.spec.group_s * factor * self.rng.uniform(0.7, 1.3)
            if self.stop.wait(seconds):
                return False  # the group in hand is abandoned: a stopped worker uploads nothing partial
            self.uploading = True
            try:
                self._upload(rec.store, rec.version)
            finally:
                self.uploading = False
            if self.kind == "crashy" and self.rng.random() < self.spec.crash_p:
                return True
        return False

    # -- records ---------------------------------------------------------------------------------------
    def _upload(self, store: S3Store, version: int) -> None:
        """One group: honest, or from a hostile worker a bad record half the time, the kinds in turn; its
        first group comes with one record of every bad kind, so even a short run injects all eight."""
        if self.kind == "hostile" and self.hostile_turn == 0:
            self.hostile_turn = len(HOSTILE)
            for bad in HOSTILE:
                self._put(store, version, bad)
        bad = None
        if self.kind == "hostile" and self.rng.random() < 0.5:
            bad = HOSTILE[self.hostile_turn % len(HOSTILE)]
            self.hostile_turn += 1
        self._put(store, version, bad)

    def _put(self, store: S3Store, version: int, bad: str | None) -> None:
        group_id = f"g{time.time_ns() // 1_000_000:013d}-{self.rng.getrandbits(32):08x}"
        key, blob = self._bad(bad, version, group_id) if bad else self._good(version, group_id)
        t = time.time()
        try:
            store.put_if_absent(key, blob)
        except PreconditionFailed:
            pass  # an earlier attempt of this very put landed and its answer was lost: it is in the bucket
        except StoreError:
            self.report.upload_failures += 1  # botocore's retries ran out; it may or may not have landed
            self.report.uploads.append({"key": key, "expect": bad, "t": t, "version": version, "sure": False})
            return
        self.report.uploads.append({"key": key, "expect": bad, "t": t, "t_done": time.time(), "version": version,
                                    "sure": True})

    def _record(self, version: int, group_id: str, *, n: int | None = None, plane: str = "bf16",
                token_hi: int | None = None, logprob_sign: float = -1.0) -> RolloutRecord:
        s, rng = self.spec, self.rng
        vocab = token_hi or s.vocab_size
        samples = []
        for _ in range(n or s.n_samples):
            length = rng.randint(*s.response_tokens)
            samples.append(Sample(response_ids=[rng.randrange(vocab) for _ in range(length)],
                                  behavior_logprobs=[logprob_sign * rng.expovariate(3.0) for _ in range(length)],
                                  loss_mask=[1] * length, reward=float(rng.random() < 0.4), finish_reason="stop"))
        prompt = [rng.randrange(s.vocab_size) for _ in range(rng.randint(*s.prompt_tokens))]
        return RolloutRecord(run=self.run, worker_id=self.id, group_id=group_id, policy_version=version,
                             plane=plane, task="gsm8k", prompt_id=f"p{rng.randrange(7473)}", prompt_ids=prompt,
                             sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=s.max_new_tokens),
                             samples=samples, created_at=time.time())

    def _good(self, version: int, group_id: str) -> tuple[str, bytes]:
        return (layout.rollout_key(self.run, version, self.id, group_id),
                encode_record(self._record(version, group_id)))

    def _bad(self, reason: str, version: int, group_id: str) -> tuple[str, bytes]:
        key = layout.rollout_key(self.run, version, self.id, group_id)
        if reason == "malformed":
            return key, zlib.compress(os.urandom(512))  # not zstd
        if reason == "bad_key":
            return layout.rollout_version_prefix(self.run, version) + f"{self.id}/{group_id}.txt", b"junk"
        kw = {"wrong_plane": {"plane": "int8g64"}, "group_size": {"n": self.spec.n_samples // 2},
              "vocab": {"token_hi": self.spec.vocab_size + 1000}, "logprob_positive": {"logprob_sign": 1.0}}
        if reason == "future_version":
            rec = self._record(version + 1000, group_id)  # filed under the version it holds, claiming one ahead
        elif reason == "key_mismatch":
            rec = self._record(version, group_id + "x")
        else:
            rec = self._record(version, group_id, **kw[reason])
        if reason == "vocab":  # make sure at least one token is out of range
            s0 = rec.samples[0]
            bad = Sample(response_ids=[self.spec.vocab_size + 5, *s0.response_ids[1:]],
                         behavior_logprobs=s0.behavior_logprobs, loss_mask=s0.loss_mask, reward=s0.reward,
                         finish_reason=s0.finish_reason)
            rec = rec.model_copy(update={"samples": [bad, *rec.samples[1:]]})
        return key, encode_record(rec)


def worker_process(indices: list[int], kinds: list[str], offsets: list[float], spec: FleetSpec, run: str,
                   endpoint: str, go, go_time, stop_event, out_queue) -> None:
    """One process of the fleet: says it is ready (imports done), waits for `go`, then runs a thread per
    worker, each starting `offset` seconds after `go_time`, until `duration_s` after it or `stop_event`;
    then the reports go to `out_queue`."""
    import boto3

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.ERROR)
    session, lock, stop = boto3.session.Session(), threading.Lock(), threading.Event()
    session.get_available_services()  # load what the clients need before the clock starts
    out_queue.put(("ready", indices[0]))
    go.wait()
    starts = [go_time.value + o for o in offsets]
    stop_at = go_time.value + spec.duration_s
    workers = [SimWorker(i, k, spec, run, endpoint, session, lock, stop, s) for i, k, s in
               zip(indices, kinds, starts, strict=True)]
    threads = [threading.Thread(target=w.run_forever, daemon=True, name=w.id) for w in workers]
    for t in threads:
        t.start()
    while time.time() < stop_at and not stop_event.is_set():
        stop_event.wait(0.5)
    stop.set()
    # every upload in flight ends (a thread still downloading, a 3 GB anchor say, uploads nothing once stopped)
    deadline = time.time() + 120
    time.sleep(1.0)  # a thread past its last look at `stop` is in its upload by now
    while time.time() < deadline and any(t.is_alive() and w.uploading for t, w in zip(threads, workers, strict=True)):
        time.sleep(0.2)
    out_queue.put(("workers", [_snapshot(w.report) for w in workers]))


def _snapshot(report: WorkerReport) -> dict:
    """A copy of the report; a thread still downloading may add a join or a version meanwhile (it uploads
    nothing once stopped), so copy until no dict changed size under the copy."""
    while True:
        try:
            return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                    for k, v in report.__dict__.items()}
        except RuntimeError:
            time.sleep(0.01)
