"""An S3 server on loopback that answers conditional writes and multipart uploads as R2 does: moto's S3 app
behind a WSGI layer enforcing the R2 rules moto lacks (one concurrent write per key, else 429, which makes
moto's check-then-write atomic; equal multipart parts, else 400 InvalidPart), recording every request.
Hand-written because no S3 server on the package registries enforces `If-None-Match` atomically; a test
tool, never in production. What it models and where it still differs from R2: docs/contract.md ("R2's
semantics, tested")."""

from __future__ import annotations

import io
import re
import threading
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qs

_ERR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{}</Code><Message>{}</Message></Error>"


@dataclass
class Seen:
    method: str
    key: str
    query: dict
    headers: dict
    status: int = 0


@dataclass
class R2Rules:
    """WSGI middleware over moto's S3 application."""

    app: object
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _writing: set = field(default_factory=set)
    _parts: dict = field(default_factory=dict)  # (upload id, part number) -> bytes

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        bucket, _, key = path.lstrip("/").partition("/")
        headers = {h: environ[f"HTTP_{h.upper().replace('-', '_')}"] for h in ("range", "if-none-match", "if-match")
                   if f"HTTP_{h.upper().replace('-', '_')}" in environ}
        seen = Seen(method, key, query, headers)
        with self._lock:
            self.seen.append(seen)

        def start(status, hdrs, exc_info=None):
            seen.status = int(status.split()[0])
            return start_response(status, hdrs, exc_info)

        if method == "PUT" and "partNumber" in query and "uploadId" in query:
            self._parts[(query["uploadId"][0], int(query["partNumber"][0]))] = int(environ.get("CONTENT_LENGTH") or 0)
            return self.app(environ, start)
        writes = key and (method == "PUT" and "partNumber" not in query or method == "POST" and "uploadId" in query)
        if not writes:
            return self.app(environ, start)
        with self._lock:
            busy = (bucket, key) in self._writing
            self._writing.add((bucket, key))
        if busy:
            return self._error(start, "429 Too Many Requests", "TooManyRequests",
                               "Reduce your concurrent request rate for the same object.")
        try:
            if method == "POST" and not self._equal_parts(environ, query["uploadId"][0]):
                return self._error(start, "400 Bad Request", "InvalidPart",
                                   "All non-trailing parts must have the same length.")
            return list(self.app(environ, start))  # the write happens here, while the key is held
        finally:
            with self._lock:
                self._writing.discard((bucket, key))

    def _equal_parts(self, environ, upload_id: str) -> bool:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
        sizes = [self._parts.get((upload_id, n), 0) for n in numbers]
        return len(set(sizes[:-1])) <= 1 and (len(sizes) < 2 or sizes[-1] <= sizes[0])

    @staticmethod
    def _error(start, status: str, code: str, message: str):
        body = _ERR.format(code, message).encode()
        start(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]

    def holding(self, bucket: str, key: str) -> bool:
        """Whether a write of `key` is in flight right now (a concurrent write of it is answered 429)."""
        with self._lock:
            return (bucket, key) in self._writing

    def statuses(self, method: str | None = None) -> list[int]:
        return [s.status for s in self.seen if method in (None, s.method)]


class R2Server:
    """moto with R2's rules on 127.0.0.1 (`start()` / `stop()`); `.rules` holds what it saw."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self.rules = R2Rules(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.rules, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> R2Server:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)

    def new_bucket(self, client) -> str:
        name = f"r2-{uuid.uuid4().hex[:20]}"
        client.create_bucket(Bucket=name)
        return name
