"""Invoke tasks for the BM25 retriever: `invoke retriever` (serve), `retriever.build`, `retriever.status`.

The served URL goes on the fleet join card: export DRL_RETRIEVER_URL=http://<reachable host>:<port>
before `invoke joincard`. Each task is a few lines that build an argv and call `infra.retriever.main`.
"""

from __future__ import annotations

import shlex
import sys

from invoke import Collection

from .taskkit import UsageError, int_flag, stoa_task


def _run(argv: list[str], dry_run: bool) -> None:
    cmd = [sys.executable, "-m", "infra.retriever", *argv]
    if dry_run:
        print("DRY RUN:", shlex.join(cmd))
        return
    from invoke import Exit

    from infra.retriever.__main__ import main

    rc = main(argv)
    if rc:
        raise Exit(code=rc)


@stoa_task(default=True, help={
    "index": "index directory written by retriever.build",
    "corpus": "JSONL corpus to index in memory instead (small corpora)",
    "host": "bind address; 127.0.0.1 by default, 0.0.0.0 to serve the fleet",
    "port": "TCP port (default 8000)",
    "dry_run": "print the command and exit",
})
def serve(c, index="", corpus="", host="127.0.0.1", port=None, dry_run=False):
    """Serve BM25 search over HTTP (GET /health, POST /search) until interrupted."""
    port = int_flag("--port", port, 8000, minimum=1)
    if port > 65535:
        raise UsageError(f"--port={port} is out of range 1-65535")
    argv = ["serve", "--host", host, "--port", str(port)]
    argv += ["--index", index] if index else []
    argv += ["--corpus", corpus] if corpus else []
    _run(argv, dry_run)


@stoa_task(help={"corpus": "JSONL corpus (omit with --download)", "download": "fetch the real PubMed corpus",
                 "out": "index directory (required)", "limit": "index only the first N documents",
                 "dry_run": "print only"})
def build(c, out=None, corpus="", download=False, limit=None, dry_run=False):
    """Build and save the BM25 index."""
    if not out:
        raise UsageError("--out is required: the directory the index is written to")
    limit = int_flag("--limit", limit, 0, minimum=1)
    argv = ["build", "--out", out]
    argv += ["--corpus", corpus] if corpus else []
    argv += ["--download"] if download else []
    argv += ["--limit", str(limit)] if limit else []
    _run(argv, dry_run)


@stoa_task(help={"url": "retriever URL; default $DRL_RETRIEVER_URL"})
def status(c, url=""):
    """Read-only: ask a running retriever for its health and document count."""
    import os
    from urllib.parse import urlparse

    from worker_contract.tasks.psqa_retrieval import RetrieverClient, RetrieverError

    url = url or os.environ.get("DRL_RETRIEVER_URL", "")
    if not url:
        raise UsageError("status needs --url or DRL_RETRIEVER_URL (http://<host>:<port> of the retriever)")
    if urlparse(url).scheme not in ("http", "https") or not urlparse(url).netloc:
        raise UsageError(f"retriever URL {url!r} must be an http:// or https:// URL")
    try:
        h = RetrieverClient(url, timeout_s=5).health()
    except RetrieverError as e:
        raise UsageError(f"retriever at {url} is not healthy: {e}") from None
    print(f"{url}: {h.status}, {h.documents} documents, corpus {h.corpus}, api v{h.api_version}")


ns = Collection("retriever", serve, build, status)
