"""The fleet's bucket and wire: moto's S3 server in its own process on 127.0.0.1, our fault proxy in front
of it with R2-like conditions, and the proxy's observer counting every request by identity, S3 operation
and object kind (what R2 would bill, and what each worker asked for). With a real fleet's sizes
(FleetSizes) anchor shards and patches are declared that big: their time on the wire and their bytes are
the declared ones, and a learner's anchor upload counts the multipart requests it would take."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from urllib.parse import parse_qs, unquote

from bench.faultproxy import FaultProxy, Latency, Request
from worker_contract import layout
from worker_contract.store.s3 import DEFAULT_PART_SIZE

from .spec import FleetSpec

BUCKET = "stoa-fleet"
LEARNER_KEY = "AKIAFLEETLEARNER0001"
SECRET = "fleet-simulator-secret-not-a-real-one-000000"
#: R2 bills these as class A (writes, lists, multipart steps) and class B (reads); DELETE is free
CLASS_A = {"PUT", "LIST", "MPU_CREATE", "MPU_PART", "MPU_COMPLETE"}
CLASS_B = {"GET", "HEAD"}


#: connections a learner's multipart upload keeps busy (S3Store's default max_concurrency)
UPLOAD_STREAMS = 8


class FleetSizes:
    """The declared size of each anchor shard and patch of a run (a real fleet's, on the small model's
    objects): `anchor_bytes` split over `anchor_shards` (whole bytes, summing to it), `patch_bytes` each."""

    def __init__(self, spec: FleetSpec, run: str):
        self.run, self.spec = run, spec
        self.shards = spec.anchor_shards

    def of(self, key: str) -> int | None:
        """Declared bytes of the object at `key`, or None where its own bytes count."""
        parts = key.split("/")
        if not parts or parts[0] != self.run:
            return None
        if self.spec.patch_bytes and layout.patch_version_of(key) is not None:
            return self.spec.patch_bytes
        name = parts[-1]
        if (self.spec.anchor_bytes and len(parts) == 4 and parts[1] == "anchors" and name.startswith("weights-")
                and name.endswith(".safetensors") and name[8:-12].isdigit()):
            shard = int(name[8:-12])
            base, extra = divmod(self.spec.anchor_bytes, self.shards)
            return base + (shard < extra) if shard < self.shards else 0
        return None

    def __call__(self, req: Request) -> tuple[int, int] | None:
        """The proxy's sizer: (declared bytes, connections) of a sized GET answer or PUT body."""
        key = unquote(req.path.split("/", 2)[2]) if req.path.count("/") >= 2 else ""
        size = self.of(key)
        if size is None:
            return None
        streams = 1
        if req.method == "PUT" and "/anchors/" in key:  # the learner's upload_file: parts, several at once
            streams = min(UPLOAD_STREAMS, -(-size // DEFAULT_PART_SIZE))
        return size, streams


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
        # sized objects (FleetSizes): requests a real-size upload adds (multipart), declared bytes by second
        self.modeled: Counter = Counter()  # (role, op, kind) -> requests beyond the one the proxy saw
        self.declared: Counter = Counter()  # (role, op, kind) -> declared bytes of sized bodies moved
        self.sized_requests: Counter = Counter()  # (role, op, kind) -> sized requests answered 200
        self.down_per_s: dict[int, float] = defaultdict(float)  # second since t0 -> answer bytes on the wire
        self.transfers: list[tuple[float, float]] = []  # (start, end) seconds since t0 of each sized transfer

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
                sized = req.declared_bytes if req.transfer is not None else None
                up = sized if sized is not None and op == "PUT" else req.length
                down = sized if sized is not None and op == "GET" else (req.resp_bytes if op != "HEAD" else 0)
                self.bytes_up[(role, kind)] += up
                self.bytes_down[(role, kind)] += down
                if sized is not None:
                    self.sized_requests[(role, op, kind)] += 1
                    self.declared[(role, op, kind)] += sized
                    a, b = req.transfer[0] - self.t0, req.transfer[1] - self.t0
                    self.transfers.append((a, b))
                    if op == "GET":
                        _spread(self.down_per_s, a, b, sized)
                    if op == "PUT" and kind == "anchor" and sized > DEFAULT_PART_SIZE:
                        # S3Store's create-only upload: a HEAD, CreateMultipartUpload, the parts, Complete
                        parts = -(-sized // DEFAULT_PART_SIZE)
                        for k, n in (("HEAD", 1), ("MPU_CREATE", 1), ("MPU_PART", parts), ("MPU_COMPLETE", 1),
                                     ("PUT", -1)):
                            self.modeled[(role, k, kind)] += n
                elif op != "HEAD":
                    self.down_per_s[second] += down
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
                "modeled": {" ".join(k): v for k, v in sorted(self.modeled.items())},
                "declared": {" ".join(k): v for k, v in sorted(self.declared.items())},
                "sized_requests": {" ".join(k): v for k, v in sorted(self.sized_requests.items())},
                "down_per_s": {s: round(b) for s, b in sorted(self.down_per_s.items())},
                "sized_in_flight_peak": _peak(self.transfers),
            }


def _spread(per_s: dict[int, float], a: float, b: float, nbytes: int) -> None:
    """Add `nbytes` moved evenly over [a, b] seconds to the per-second buckets it overlaps."""
    if b <= a:
        per_s[int(a)] += nbytes
        return
    s = int(a)
    while s < b:
        per_s[s] += nbytes * (min(b, s + 1) - max(a, s)) / (b - a)
        s += 1


def _peak(spans: list[tuple[float, float]]) -> int:
    """Most spans open at one instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


def start_proxy(spec: FleetSpec, upstream: str, stats: WireStats) -> FaultProxy:
    latency = Latency(spec.latency_median_s, spec.latency_p99_s, spec.bandwidth_bps)
    return FaultProxy(upstream, rate=spec.fault_rate, kinds=("503", "429", "reset", "lost"), seed=spec.seed,
                      latency=latency, cap_rps=spec.cap_rps or None, cap_burst=spec.cap_burst, keep_log=False,
                      observer=stats, sizer=FleetSizes(spec, stats.run) if spec.sized else None).start()
