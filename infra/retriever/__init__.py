"""BM25 retriever service for PaperSearchQA (light-tier Macs, 15-23 GB, cannot hold the index).

corpus.py  - corpus loaders (the real PubMed corpus; a small generated corpus for tests and smoke runs)
index.py   - the BM25 index (bm25s: sparse-matrix BM25, saved to disk and memory-mapped when served)
server.py  - HTTP service: GET /health, POST /search (wire types in worker_contract.tasks.psqa_retrieval)
__main__   - `python -m infra.retriever build|serve|generate`; the Invoke task is infra/retriever_tasks.py
API for users: docs/retriever.md.
"""

import sys
from pathlib import Path


def serve_argv(corpus: str | Path, port: int | str, host: str = "127.0.0.1") -> list[str]:
    """The command that serves `corpus` (JSONL, indexed in memory) on host:port: what the embedded psqa run starts
    as its child process (embedded/psqa.py)."""
    return [sys.executable, "-m", "infra.retriever", "serve", "--corpus", str(corpus), "--host", host,
            "--port", str(port)]
