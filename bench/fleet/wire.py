"""The fleet's bucket and wire: moto's S3 server in its own process on 127.0.0.1, our fault proxy in front
of it with R2-like conditions, and the proxy's observer counting every request by identity, S3 operation
and object kind (what R2 would bill, and what each worker asked for)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from urllib.parse import parse_qs, unquote

from bench.faultproxy import FaultProxy, Latency, Request

from .spec import FleetSpec

BUCKET = "stoa-fleet"
LEARNER_KEY = "AKIAFLEETLEARNER0001"
SECRET = "fleet-simulator-secret-not-a-real-one-000000"
#: R2 bills these as class A (writes, lists, multipart steps) and class B (reads); DELETE is free
CLASS_A = {"PUT", "LIST", "MPU_CREATE", "MPU_PART", "MPU_COMPLETE"}
CLASS_B = {"GET", "HEAD"}


def worker_key(index: int) -> str:
    return f"AKIAFLEETW{index:06d}"


def store_env(endpoint: str, access_key: str) -> dict[str, str]:
    return {"DRL_S3_ENDPOINT": endpoint, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": SECRET}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoProcess:
    """`python -m moto.server` on a free loopback port, in its own session; stopped by its PID."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto's S3 server exited at start") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto's S3 server did not listen within 60 s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def s3_op(req: Request) -> str:
    q = req.query
    if req.method == "GET" and ("list-type" in q or req.path.rstrip("/").count("/") == 1):
        return "LIST"
    if req.method == "PUT":
        return "MPU_PART" if "partNumber=" in q else "PUT"
    if req.method == "POST":
        return "MPU_COMPLETE" if "uploadId=" in q else "MPU_CREATE"
    return req.method  # GET, HEAD, DELETE


def object_kind(req: Request, run: str, op: str) -> str:
    if op == "LIST":
        key = unquote(parse_qs(req.query).get("prefix", [""])[0])
    else:
        key = unquote(req.path.split("/", 2)[2] if req.path.count("/") >= 2 else "")
    rest = key[len(run) + 1:] if key.startswith(run + "/") else None
    if rest is None:
        return "other"
    head = rest.split("/", 1)[0]
    return {"current.json": "pointer", "run.json": "manifest", "anchors": "anchor", "versions": "patch",
            "rollouts": "rollout", "stats": "stats"}.get(head, "other")


def role_of(access_key: str) -> str:
    if access_key == LEARNER_KEY:
        return "learner"
    return "worker" if access_key.startswith("AKIAFLEETW") else "other"


class WireStats:
    """The proxy's observer: what crossed the wire, by role (learner / worker), S3 operation and object kind.
    `billed` counts requests the server answered (R2 bills those); faults the proxy answered are apart."""

    def __init__(self, run: str):
        self.run = run
        self.t0, self.wall0 = time.monotonic(), time.time()
        self._lock = threading.Lock()
        self.billed: Counter = Counter()  # (role, op, kind) -> requests the server answered
        self.bytes_up: Counter = Counter()  # (role, kind) -> request body bytes
        self.bytes_down: Counter = Counter()  # (role, kind) -> answer body bytes
        self.faults: Counter = Counter()  # (role, fault) -> injected
        self.per_identity: dict[str, Counter] = defaultdict(Counter)  # access key -> "op kind" -> requests
        self.timeline: dict[int, Counter] = defaultdict(Counter)  # second since t0 -> requests, capped, faults
        self.statuses: Counter = Counter()
        self.learner_lists: dict[str, float] = {}  # listed prefix -> wall time of the learner's latest LIST of it

    def __call__(self, req: Request) -> None:
        op = s3_op(req)
        kind = object_kind(req, self.run, op)
        role = role_of(req.access_key)
        second = int(req.t - self.t0)
        with self._lock:
            tl = self.timeline[second]
            tl["requests"] += 1
            if req.fault:
                self.faults[(role, req.fault)] += 1
                tl["capped" if req.fault == "cap" else "faults"] += 1
            if req.fault in (None, "lost", "slow") and req.status is not None:
                self.billed[(role, op, kind)] += 1
                self.bytes_up[(role, kind)] += req.length
                self.bytes_down[(role, kind)] += req.resp_bytes if op != "HEAD" else 0
                self.per_identity[req.access_key][f"{op} {kind}"] += 1
                self.statuses[req.status] += 1
                if op == "LIST" and role == "learner" and req.status == 200:
                    prefix = unquote(parse_qs(req.query).get("prefix", [""])[0])
                    self.learner_lists[prefix] = max(self.learner_lists.get(prefix, 0.0),
                                                     self.wall0 + (req.t - self.t0))

    def snapshot(self) -> dict:
        """JSON-ready copy of every counter."""
        with self._lock:
            return {
                "wall0": self.wall0,
                "billed": {" ".join(k): v for k, v in sorted(self.billed.items())},
                "bytes_up": {" ".join(k): v for k, v in sorted(self.bytes_up.items())},
                "bytes_down": {" ".join(k): v for k, v in sorted(self.bytes_down.items())},
                "faults": {" ".join(k): v for k, v in sorted(self.faults.items())},
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "per_identity": {k: dict(v) for k, v in self.per_identity.items()},
                "timeline": {s: dict(c) for s, c in sorted(self.timeline.items())},
                "learner_lists": dict(self.learner_lists),
            }


def start_proxy(spec: FleetSpec, upstream: str, stats: WireStats) -> FaultProxy:
    latency = Latency(spec.latency_median_s, spec.latency_p99_s, spec.bandwidth_bps)
    return FaultProxy(upstream, rate=spec.fault_rate, kinds=("503", "429", "reset", "lost"), seed=spec.seed,
                      latency=latency, cap_rps=spec.cap_rps or None, cap_burst=spec.cap_burst, keep_log=False,
                      observer=stats).start()
