"""The retriever's wire format and a stdlib HTTP client (PaperSearchQA search tool).

One module owns this wire format (one module owns a wire format): the server (`infra/retriever/`) and every worker import
these types. API, documented for users in docs/retriever.md:

    GET  /health                              -> HealthResponse
    POST /search  {"query": str, "k": int}     -> SearchResponse (hits ranked best first)

The client uses urllib only, so a Mac worker needs nothing beyond the contract core to call a shared
retriever (the light tier, 15-23 GB, cannot hold the BM25 index itself).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError

API_VERSION = 1
MAX_K = 50
MAX_QUERY_CHARS = 2000


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SearchRequest(_Wire):
    """Body of `POST /search`."""

    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    """Free-text query (the model's `<search>` text)."""
    k: int = Field(3, ge=1, le=MAX_K)
    """How many documents to return, best first."""


class SearchHit(_Wire):
    """One retrieved document."""

    id: str
    """Stable id of the document in the corpus (PubMed: the PMID when known, else the corpus row)."""
    title: str
    """Paper title."""
    text: str
    """Abstract (or the whole `contents` when the corpus has no separate title)."""
    score: float
    """BM25 score; higher is better. Scores compare only within one response."""


class SearchResponse(_Wire):
    """Body of a `POST /search` answer."""

    api_version: int = API_VERSION
    """Version of this wire format."""
    query: str
    """The query as received."""
    hits: list[SearchHit]
    """At most k hits, ranked best first; documents with zero score are left out."""


class HealthResponse(_Wire):
    """Body of `GET /health`."""

    status: str = "ok"
    """'ok' once the index is loaded and queries are served."""
    api_version: int = API_VERSION
    """Version of this wire format."""
    documents: int
    """Documents in the index."""
    corpus: str
    """Where the corpus came from (a path or a data set id), for the operator."""


class RetrieverError(RuntimeError):
    """The retriever could not be reached or answered with an error."""


#: the largest answer body read (k = 50 abstracts fit many times over); a longer one is a failed call
MAX_RESPONSE_BYTES = 4 * 1024 * 1024


def check_url(url: str) -> str:
    """`url` if a request can be sent to it (http(s), a host, a numeric port), else ValueError naming
    DRL_RETRIEVER_URL: a worker refuses it up front instead of joining to drop every group."""
    try:
        parts = urlparse(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number in 0-65535)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"DRL_RETRIEVER_URL={url!r} is not an http(s) URL with a host; e.g. http://10.0.0.5:8000")
    return url


class RetrieverClient:
    """Calls a retriever over HTTP with bounded cost: each attempt has a socket timeout and a whole-call
    deadline (a server that drips bytes is cut off), reads at most MAX_RESPONSE_BYTES, and a failed attempt
    (refused, timed out, HTTP 5xx, a body that is not the wire format) is retried `retries` more times
    with a short backoff; then `search` raises RetrieverError. HTTP 4xx is not retried (our request is wrong)."""

    def __init__(self, url: str, timeout_s: float = 20.0, retries: int = 2, backoff_s: float = 0.5,
                 max_bytes: int = MAX_RESPONSE_BYTES):
        self.url = check_url(url).rstrip("/")
        self.timeout_s, self.retries, self.backoff_s, self.max_bytes = timeout_s, retries, backoff_s, max_bytes

    def _read(self, resp, deadline: float, what: str) -> bytes:
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise RetrieverError(f"{what}: no whole answer within {self.timeout_s:g} s")
            chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise RetrieverError(f"{what}: answer larger than {self.max_bytes} bytes")
            chunks.append(chunk)

    def _once(self, method: str, path: str, body: bytes | None) -> bytes:
        what = f"{method} {self.url}{path}"
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body else {})
        deadline = time.monotonic() + self.timeout_s
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return self._read(resp, deadline, what)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode(errors="replace")
            err = RetrieverError(f"{what}: HTTP {e.code}: {detail}")
            err.retry = e.code >= 500  # type: ignore[attr-defined]
            raise err from None
        except (urllib.error.URLError, OSError, ValueError) as e:  # refused, timed out, reset
            raise RetrieverError(f"{what}: {e}") from None
        except http.client.HTTPException as e:  # not HTTP at all (a bad status line), a body cut short
            raise RetrieverError(f"{what}: {type(e).__name__}: {str(e)[:120]}") from None

    def _call(self, method: str, path: str, body: bytes | None = None, parse=None):
        for attempt in range(self.retries + 1):
            try:
                raw = self._once(method, path, body)
                if parse is None:
                    return raw
                try:
                    return parse(raw)
                except (ValidationError, ValueError) as e:
                    raise RetrieverError(f"{method} {self.url}{path}: not the retriever's wire format "
                                         f"({str(e).splitlines()[0][:120]})") from None
            except RetrieverError as e:
                if attempt == self.retries or not getattr(e, "retry", True):
                    raise
                time.sleep(self.backoff_s * (2 ** attempt))
        raise AssertionError("unreachable")

    def health(self) -> HealthResponse:
        return self._call("GET", "/health", parse=HealthResponse.model_validate_json)

    def search(self, query: str, k: int = 3) -> SearchResponse:
        req = SearchRequest(query=query[:MAX_QUERY_CHARS], k=k)
        return self._call("POST", "/search", req.model_dump_json().encode(), parse=SearchResponse.model_validate_json)


def format_hits(hits: list[SearchHit]) -> str:
    """The text the model reads inside `<information>`: numbered documents with their titles."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {i} (Title: {h.title}) {h.text}" for i, h in enumerate(hits, 1))


def dumps(model: BaseModel) -> bytes:
    return json.dumps(model.model_dump(), ensure_ascii=False).encode()


def search_tool(client: RetrieverClient, k: int = 3, strict: bool = False):
    """The `Search` callable an episode uses: query -> formatted documents. A retriever failure (after the
    client's retries) becomes a short tool message, or with `strict` (the workers) raises RetrieverError so
    the worker drops the group with a counted reason instead of training on an episode the tool failed."""

    def search(query: str) -> str:
        try:
            return format_hits(client.search(query, k).hits)
        except RetrieverError as e:
            if strict:
                raise
            return f"Search failed ({str(e)[:200]})."

    return search
