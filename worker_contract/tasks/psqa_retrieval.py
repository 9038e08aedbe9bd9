"""The retriever's wire format and a stdlib HTTP client (PaperSearchQA search tool).

One module owns this wire format (STYLE rule 2): the server (`infra/retriever/`) and every worker import
these types. API, documented for users in docs/retriever.md:

    GET  /health                              -> HealthResponse
    POST /search  {"query": str, "k": int}     -> SearchResponse (hits ranked best first)

The client uses urllib only, so a Mac worker needs nothing beyond the contract core to call a shared
retriever (the light tier, 15-23 GB, cannot hold the BM25 index itself).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pydantic import BaseModel, ConfigDict, Field

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


class RetrieverClient:
    """Calls a retriever over HTTP. `search` raises RetrieverError; the episode loop turns that into
    an empty tool turn rather than a dead worker (the group still completes and scores)."""

    def __init__(self, url: str, timeout_s: float = 20.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"DRL_RETRIEVER_URL={url!r} is not an http(s) URL; e.g. http://10.0.0.5:8000")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise RetrieverError(f"{method} {self.url}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RetrieverError(f"{method} {self.url}{path}: {e}") from None

    def health(self) -> HealthResponse:
        return HealthResponse.model_validate_json(self._call("GET", "/health"))

    def search(self, query: str, k: int = 3) -> SearchResponse:
        req = SearchRequest(query=query[:MAX_QUERY_CHARS], k=k)
        return SearchResponse.model_validate_json(self._call("POST", "/search", req.model_dump_json().encode()))


def format_hits(hits: list[SearchHit]) -> str:
    """The text the model reads inside `<information>`: numbered documents with their titles."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {i} (Title: {h.title}) {h.text}" for i, h in enumerate(hits, 1))


def dumps(model: BaseModel) -> bytes:
    return json.dumps(model.model_dump(), ensure_ascii=False).encode()


def search_tool(client: RetrieverClient, k: int = 3):
    """The `Search` callable an episode uses: query -> formatted documents. A retriever failure becomes a
    short tool message instead of an exception, so one flaky request never kills a worker's group."""

    def search(query: str) -> str:
        try:
            return format_hits(client.search(query, k).hits)
        except RetrieverError as e:
            return f"Search failed ({str(e)[:200]})."

    return search
