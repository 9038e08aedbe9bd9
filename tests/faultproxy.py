"""A loopback HTTP proxy between a client and an S3 server that injects faults, for reliability tests.

Point boto3's endpoint at `proxy.url`; every request is forwarded to `upstream` unless a fault is chosen:

    "503"     answer 503 ServiceUnavailable without forwarding (the server never saw the request)
    "429"     answer 429 TooManyRequests without forwarding (R2's per-key write limit)
    "reset"   read the request, then reset the connection without forwarding
    "lost"    forward it (the server acts on it), then reset the connection: the answer is lost
    "slow"    forward it, then hold the answer `slow_s` seconds (longer than the client's read timeout)

Faults come from a script first (`inject`, for exact scenarios), else at random with probability `rate`
among `kinds`, from `random.Random(seed)`, so a run is reproducible. Every request is recorded in `log`.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("503", "429", "reset", "lost", "slow")
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
_ERROR_BODY = {
    "503": (503, b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"),
    "429": (429, b"<Error><Code>TooManyRequests</Code><Message>injected</Message></Error>"),
}


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


Match = Callable[[Request], bool]


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.0, kinds: Iterable[str] = ("503", "429"),
                 seed: int = 0, slow_s: float = 2.0):
        self.upstream = urlsplit(upstream)
        self.rate, self.kinds, self.slow_s = rate, tuple(kinds), slow_s
        assert set(self.kinds) <= set(KINDS), self.kinds
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

    def _choose(self, req: Request) -> str | None:
        with self._lock:
            self.log.append(req)
            for i, (fault, match) in enumerate(self._script):
                if match(req):
                    del self._script[i]
                    return fault
            if self.rate and self._rng.random() < self.rate:
                return self._rng.choice(self.kinds)
            return None


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

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

        def _respond(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for k, v in headers:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            if self.command == "HEAD":
                length = next((v for k, v in headers if k.lower() == "content-length"), "0")
                self.send_header("Content-Length", length)
                self.end_headers()
            else:
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path, _, query = self.path.partition("?")
            req = Request(self.command, path, query, length, None,
                          headers={k.lower(): v for k, v in self.headers.items()})
            req.fault = fault = proxy._choose(req)
            if fault in _ERROR_BODY:
                req.status, data = _ERROR_BODY[fault]
                return self._respond(req.status, [("Content-Type", "application/xml")], data)
            if fault == "reset":
                return self._reset()
            req.status, headers, data = self._forward(body)
            if fault == "lost":
                return self._reset()
            if fault == "slow" and proxy._stopping.wait(proxy.slow_s):
                return self._reset()
            self._respond(req.status, headers, data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler
