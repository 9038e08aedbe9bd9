"""The workers' retriever client against a retriever that is down, slow, failing or answering garbage: the
real BM25 server on 127.0.0.1, and a small fault-injecting HTTP server in front of it for what the real one
never does (500s, malformed JSON, an endless body). Every failure is a RetrieverError within a bounded
time after the bounded retries, the body read stays capped, and a transient 500 is retried through."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.retriever.corpus import synthetic_corpus
from infra.retriever.index import BM25Index
from infra.retriever.server import make_server
from worker_contract.tasks.psqa_retrieval import RetrieverClient, RetrieverError, search_tool

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    BM25Index.build(synthetic_corpus(60, seed=5), source="generated").save(d)
    srv = make_server(BM25Index.load(d), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


class Faults(ThreadingHTTPServer):
    """mode: 'pass' (forward to the real server), '500', 'malformed', 'huge', 'slow', 'drip', 'not-http' (bytes
    that are no HTTP status line), 'short' (a body cut off before its Content-Length); `fail_first`
    requests get the fault, later ones pass (0 = all of them)."""

    daemon_threads = True

    def __init__(self, upstream: str, mode: str, fail_first: int = 0):
        super().__init__(("127.0.0.1", 0), _FaultHandler)
        self.upstream, self.mode, self.fail_first = upstream, mode, fail_first
        self.requests, self.sent = 0, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FaultHandler(BaseHTTPRequestHandler):
    server: Faults
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    def _reply(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        srv.requests += 1
        mode = srv.mode if not srv.fail_first or srv.requests <= srv.fail_first else "pass"
        if mode == "pass":
            req = urllib.request.Request(srv.upstream + self.path, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return self._reply(200, r.read())
            except urllib.error.HTTPError as e:
                return self._reply(e.code, e.read())
        if mode == "500":
            return self._reply(500, b'{"error": "index shard lost"}')
        if mode == "malformed":
            return self._reply(200, b'{"api_version": 1, "query": "x", "hits": [{"id": 1')
        if mode == "not-http":
            self.close_connection = True
            self.wfile.write(b"\x00\x17garbage, not a status line\r\n\r\n")
            return None
        if mode == "short":
            self.close_connection = True
            return self._reply(200, b'{"api_version": 1, "query": "x", "hi', length=4096)
        if mode == "slow":
            time.sleep(TIMEOUT * 3)
            return self._reply(200, b"{}")
        chunk, total = b"a" * 65536, 64 * 1024 * 1024
        self.send_response(200)
        self.send_header("Content-Length", str(total))
        self.end_headers()
        try:
            while srv.sent < total:
                self.wfile.write(chunk)
                srv.sent += len(chunk)
                if mode == "drip":
                    time.sleep(0.2)
        except OSError:  # the client hung up: what a capped read should make it do
            pass


@pytest.fixture
def faults(real):
    made = []

    def start(mode: str, fail_first: int = 0) -> Faults:
        srv = Faults(real.url, mode, fail_first)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
        return srv

    yield start
    for srv in made:
        srv.shutdown()
        srv.server_close()


def _client(url: str, **kw) -> RetrieverClient:
    return RetrieverClient(url, timeout_s=TIMEOUT, retries=2, backoff_s=0.05, **kw)


def _fails(client: RetrieverClient, needle: str, limit_s: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match=needle):
        client.search("dystrophin muscle")
    assert time.monotonic() - t0 < limit_s


def test_the_real_server_answers_through_the_client(real):
    assert _client(real.url).search("dystrophin insulin", 2).hits


def test_down(real):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails(_client(f"http://127.0.0.1:{port}"), "Connection refused", 3.0)
    with pytest.raises(RetrieverError):  # search_tool(strict=True) is what the workers use: it raises too
        search_tool(_client(f"http://127.0.0.1:{port}"), strict=True)("x")


@pytest.mark.parametrize("mode, needle", [("500", "HTTP 500"), ("malformed", "not the retriever's wire format"),
                                          ("slow", "timed out"), ("not-http", "BadStatusLine"),
                                          ("short", "not the retriever's wire format")])
def test_failing_answers_are_retried_then_raised(faults, mode, needle):
    srv = faults(mode)
    _fails(_client(srv.url), needle, 3 * TIMEOUT * 1.5 + 1.0)
    assert srv.requests == 3  # one call and two retries, no more


def test_a_transient_500_is_retried_through(faults):
    srv = faults("500", fail_first=2)
    assert _client(srv.url).search("dystrophin insulin", 2).hits and srv.requests == 3


@pytest.mark.parametrize("mode, needle", [("huge", "larger than 1048576 bytes"), ("drip", "no whole answer within")])
def test_a_huge_or_endless_body_is_cut_off_with_memory_bounded(faults, mode, needle):
    srv = faults(mode)
    tracemalloc.start()
    try:
        _fails(_client(srv.url, max_bytes=1 << 20), needle, 3 * (TIMEOUT + 0.5) + 1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # a 64 MiB body, never held
    assert srv.sent < 3 * 8 << 20


@pytest.mark.parametrize("url", ["http://", "http://:8000", "http://host:port", "http://[::1"])
def test_a_url_no_request_can_use_is_refused_up_front(url):
    with pytest.raises(ValueError, match="DRL_RETRIEVER_URL"):
        RetrieverClient(url)


def test_a_4xx_is_not_retried(faults):
    srv = faults("pass")
    client = _client(srv.url)
    with pytest.raises(RetrieverError, match="HTTP 404"):
        client._call("POST", "/nope", b"{}")
    assert srv.requests == 1
