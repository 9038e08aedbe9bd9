"""HTTP front of the BM25 index: `GET /health`, `POST /search` (docs/retriever.md).

stdlib ThreadingHTTPServer: the load is a dozen workers issuing a few searches per episode, which a
thread per request serves; no framework is worth its install on a Mac or the trainer box for that.
Binds 127.0.0.1 unless told otherwise: exposing it to the fleet is an explicit `--host 0.0.0.0`.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import ValidationError

from worker_contract.tasks.psqa_retrieval import HealthResponse, SearchRequest, SearchResponse

from .index import BM25Index

log = logging.getLogger("stoa.retriever")
MAX_BODY = 64 * 1024


class RetrieverServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) resets connections when a fleet bursts

    def __init__(self, addr: tuple[str, int], index: BM25Index, corpus_label: str):
        super().__init__(addr, _Handler)
        self.index, self.corpus_label = index, corpus_label

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RetrieverServer
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, payload: dict | str) -> None:
        body = (payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, {"error": message})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] != "/health":
            return self._error(HTTPStatus.NOT_FOUND, f"no route GET {self.path}; try GET /health or POST /search")
        health = HealthResponse(documents=self.server.index.documents, corpus=self.server.corpus_label)
        self._send(HTTPStatus.OK, health.model_dump_json())

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/search":
            return self._error(HTTPStatus.NOT_FOUND, f"no route POST {self.path}; try POST /search")
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            return self._error(HTTPStatus.BAD_REQUEST, f"body of {length} bytes; send 1..{MAX_BODY} bytes of JSON")
        raw = self.rfile.read(length)
        try:
            req = SearchRequest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return self._error(HTTPStatus.BAD_REQUEST,
                               f"{where}: {first['msg']}; expected {{\"query\": str, \"k\": 1..50}}")
        hits = self.server.index.search(req.query, req.k)
        self._send(HTTPStatus.OK, SearchResponse(query=req.query, hits=hits).model_dump_json())

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)


def make_server(index: BM25Index, host: str = "127.0.0.1", port: int = 8000, corpus_label: str = "") -> RetrieverServer:
    """Bind (port 0 picks a free one); call `serve_forever()` on the result. ValueError (one sentence) when
    the address cannot be bound: a busy port, a host that is no address of this machine."""
    try:
        return RetrieverServer((host, port), index, corpus_label or str(index.meta.get("source", "")))
    except OSError as e:
        raise ValueError(_bind_refused(host, port, e)) from None


def _bind_refused(host: str, port: int, e: OSError) -> str:
    import errno

    if e.errno == errno.EADDRINUSE:
        return f"--port {port} is in use on {host}: stop what serves there, or pick another port (0: any free one)"
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host!r} is not an address of this machine ({e.strerror or e}): use 127.0.0.1, "
                "0.0.0.0 (every interface) or one of its own addresses")
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def check_bind(host: str, port: int) -> None:
    """Refuse (ValueError) an address `serve` could not bind, before an index is built or loaded for it."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(_bind_refused(host, port, e)) from None


def serve(index: BM25Index, host: str, port: int, corpus_label: str = "") -> None:
    """Serve until SIGINT/SIGTERM, then close the socket cleanly."""
    server = make_server(index, host, port, corpus_label)

    def _stop(signum, _frame):
        log.info("signal %d: stopping", signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    print(f"retriever: {index.documents} documents, serving {server.url} (GET /health, POST /search)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
