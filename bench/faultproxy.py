"""A loopback HTTP proxy between clients and an S3 server that injects faults and R2-like conditions.

Used by the reliability tests (exact fault scripts) and by the fleet simulator (bench/fleet: latency, a
request-rate cap, random faults, per-request accounting). Point boto3's endpoint at `proxy.url`; every
request is forwarded to `upstream` unless a fault is chosen (503, 429, reset, lost, slow), from a script
(`inject`) or at random from a seeded generator. The fault kinds and conditions: docs/performance.md
(module notes). Hand-written: no maintained library proxies S3 with scripted faults and per-request
records; it is a test and benchmark tool, never on the wire in production.
"""

from __future__ import annotations

import http.client
import math
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("503", "429", "reset", "lost", "slow")
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
_ERROR_BODY = {
    "503": (503, b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"),
    "429": (429, b"<Error><Code>TooManyRequests</Code><Message>injected</Message></Error>"),
    "cap": (429, b"<Error><Code>SlowDown</Code><Message>request rate cap</Message></Error>"),
}
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")


@dataclass
class Request:
    method: str
    path: str
    query: str
    length: int
    fault: str | None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    """Request headers, names lower-cased."""
    resp_bytes: int = 0
    """Body bytes answered (for HEAD: the Content-Length the server named, none sent)."""
    delay_s: float = 0.0
    """Latency injected before answering (log-normal draw plus transfer time)."""
    access_key: str = ""
    """The access key id of the SigV4 signature: which client (identity) sent it."""
    t: float = 0.0
    """time.monotonic() when the request arrived."""
    declared_bytes: int = 0
    """The body's size as the sizer declared it (0: not sized; its real bytes count)."""
    streams: int = 1
    """Connections the declared body is modeled over (a multipart upload's parts in flight)."""
    transfer: tuple[float, float] | None = None
    """time.monotonic() span of a sized body's modeled transfer."""


Match = Callable[[Request], bool]
#: (declared bytes, connections) of a request's body (PUT) or of its 200 answer's (GET), or None: not sized
Sizer = Callable[[Request], "tuple[int, int] | None"]


@dataclass(frozen=True)
class Latency:
    """Per-request delay: log-normal with this median and 99th percentile, plus size / bandwidth."""

    median_s: float = 0.06
    p99_s: float = 0.35
    bandwidth_bps: float = 0.0
    """Bytes per second of one connection (0 = no transfer time)."""

    def __post_init__(self) -> None:
        if not 0 < self.median_s <= self.p99_s:
            raise ValueError(f"latency median {self.median_s} s must be above 0 and at most p99 {self.p99_s} s")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / 2.3263478740408408  # z of the 99th percentile

    def draw(self, rng: random.Random, nbytes: int = 0) -> float:
        base = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return base + (nbytes / self.bandwidth_bps if self.bandwidth_bps else 0.0)


class _TokenBucket:
    def __init__(self, rps: float, burst: float):
        self.rps, self.burst = rps, burst
        self.tokens, self.t = burst, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rps)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.0, kinds: Iterable[str] = ("503", "429"),
                 seed: int = 0, slow_s: float = 2.0, latency: Latency | None = None,
                 cap_rps: float | None = None, cap_burst: float | None = None, keep_log: bool = True,
                 observer: Callable[[Request], None] | None = None, sizer: Sizer | None = None):
        self.upstream = urlsplit(upstream)
        self.rate, self.kinds, self.slow_s = rate, tuple(kinds), slow_s
        assert set(self.kinds) <= set(KINDS), self.kinds
        self.latency, self.keep_log, self.observer, self.sizer = latency, keep_log, observer, sizer
        if sizer is not None and not (latency and latency.bandwidth_bps):
            raise ValueError("a sizer needs a latency with a bandwidth: declared bytes take time over it")
        self._bucket = _TokenBucket(cap_rps, cap_burst or cap_rps) if cap_rps else None
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._script: list[tuple[str, Match]] = []
        self._stopping = threading.Event()
        self.log: list[Request] = []
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def inject(self, faults: Iterable[str], match: Match = lambda r: True) -> None:
        """Queue faults for the next requests that `match`, in order, before any random ones."""
        with self._lock:
            for f in faults:
                assert f in KINDS, f
                self._script.append((f, match))

    def requests(self, method: str | None = None, query: str | None = None) -> list[Request]:
        """Recorded requests, optionally only those with this method / whose query contains `query`."""
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method)
                    and (query is None or query in r.query)]

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    def _choose(self, req: Request) -> tuple[str | None, float]:
        """(the fault for this request or None, the latency to inject before its answer)."""
        with self._lock:
            if self.keep_log:
                self.log.append(req)
            delay = self.latency.draw(self._rng) if self.latency else 0.0
            for i, (fault, match) in enumerate(self._script):
                if match(req):
                    del self._script[i]
                    return fault, delay
            if self._bucket is not None and not self._bucket.take():
                return "cap", delay
            if self.rate and self._rng.random() < self.rate:
                return self._rng.choice(self.kinds), delay
            return None, delay

    def _transfer_s(self, nbytes: int, streams: int = 1) -> float:
        bw = self.latency.bandwidth_bps if self.latency else 0.0
        return nbytes / (bw * streams) if bw else 0.0

    def _size(self, req: Request) -> bool:
        """Ask the sizer about this request; True (and the request carries its declared size) if sized."""
        sized = self.sizer(req) if self.sizer is not None else None
        if not sized:
            return False
        req.declared_bytes, req.streams = int(sized[0]), max(1, int(sized[1]))
        return True

    def _done(self, req: Request) -> None:
        if self.observer is not None:
            self.observer(req)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of simulated clients connect at once

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout, reset) is what these tests provoke: not worth a traceback."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, OSError)):
            super().handle_error(request, client_address)


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 servers do; every answer has a Content-Length

        def log_message(self, *args) -> None:  # quiet
            pass

        def _reset(self) -> None:
            """Drop the connection with a TCP reset, answering nothing."""
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            up = proxy.upstream
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Host"] = up.netloc
                conn.request(self.command, self.path, body=body if body else None, headers=headers)
                r = conn.getresponse()
                data = r.read()
                return r.status, [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP], data
            finally:
                conn.close()

        def _respond(self, status: int, headers: list[tuple[str, str]], data: bytes) -> int:
            self.send_response(status)
            for k, v in headers:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            if self.command == "HEAD":
                length = next((v for k, v in headers if k.lower() == "content-length"), "0")
                self.send_header("Content-Length", length)
                self.end_headers()
                return int(length)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return len(data)

        def _respond_paced(self, status: int, headers: list[tuple[str, str]], data: bytes, end: float) -> int:
            """The answer's headers now, its bytes in slices at most 1 s apart (a client's read timeout never
            fires on a long transfer), the last at `end` (time.monotonic())."""
            self.send_response(status)
            for k, v in headers:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.flush()
            slices = max(1, min(len(data), math.ceil(end - time.monotonic())))
            bounds = [len(data) * i // slices for i in range(slices + 1)]  # every slice holds a byte
            for i in range(slices):
                if self._wait((end - time.monotonic()) / (slices - i)):
                    self._reset()
                    return 0
                self.wfile.write(data[bounds[i]:bounds[i + 1]])
                self.wfile.flush()
            return len(data)

        def _wait(self, seconds: float) -> bool:
            """Hold for `seconds`; True if the proxy is stopping meanwhile (then answer nothing)."""
            return seconds > 0 and proxy._stopping.wait(seconds)

        def _handle(self) -> None:
            t = time.monotonic()
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path, _, query = self.path.partition("?")
            headers = {k.lower(): v for k, v in self.headers.items()}
            m = _CREDENTIAL.search(headers.get("authorization", ""))
            req = Request(self.command, path, query, length, None, headers=headers if proxy.keep_log else {},
                          access_key=m.group(1) if m else "", t=t)
            req.fault, delay = proxy._choose(req)
            delay += proxy._transfer_s(length)
            try:
                if req.fault in _ERROR_BODY:
                    req.delay_s = delay
                    if self._wait(delay):
                        return self._reset()
                    req.status, data = _ERROR_BODY[req.fault]
                    req.resp_bytes = self._respond(req.status, [("Content-Type", "application/xml")], data)
                    return
                if req.fault == "reset":
                    return self._reset()
                req.status, up_headers, data = self._forward(body)
                if req.fault == "lost":
                    return self._reset()
                sized = req.status == 200 and self.command in ("GET", "PUT") and proxy._size(req)
                if sized:  # the declared body's time replaces the real one's (sent or answered)
                    delay -= proxy._transfer_s(length)
                    transfer = proxy._transfer_s(req.declared_bytes, req.streams)
                    if self.command == "PUT":
                        req.transfer = (t + delay, t + delay + transfer)
                        delay += transfer
                    else:  # headers after the latency, then the answer's bytes paced over the transfer
                        req.delay_s = delay + transfer
                        req.transfer = (t + delay, t + delay + transfer)
                        if self._wait(delay - (time.monotonic() - t)):
                            return self._reset()
                        req.resp_bytes = self._respond_paced(req.status, up_headers, data, req.transfer[1])
                        return
                delay += proxy._transfer_s(len(data))
                req.delay_s = delay
                # the latency is paid after the server acted, so what it stores is not held back meanwhile;
                # to the client the answer arrives `delay` seconds after its request either way
                if self._wait(delay - (time.monotonic() - t)):
                    return self._reset()
                if req.fault == "slow" and self._wait(proxy.slow_s):
                    return self._reset()
                req.resp_bytes = self._respond(req.status, up_headers, data)
            finally:
                proxy._done(req)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler
