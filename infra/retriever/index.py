"""The BM25 index over the corpus, built and queried with bm25s (a maintained sparse-matrix BM25).

Why bm25s and not rank-bm25: rank-bm25 scores every document in Python per query term and keeps the
whole corpus in memory, which is hopeless at 23 million abstracts; bm25s precomputes a sparse score
matrix, saves it as numpy arrays and serves it memory-mapped, documents included (its JSONL corpus is
read by offset), so the served process stays small.

Tokenization: lower case, words of one or more characters (so "IL-6" keeps its "6"), English stop words
removed, no stemming. The vocabulary is saved with the index so queries tokenize exactly like documents.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from worker_contract.tasks.psqa_retrieval import SearchHit

SPLITTER = r"(?u)\b\w+\b"
META_FILE = "stoa_index.json"
INDEX_FORMAT = 1


def _tokenizer():
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, splitter=SPLITTER, stopwords="en")


def check_out_dir(out_dir: str | Path, source: str | Path | None = None) -> Path:
    """Where `build --out` may write: a new or empty directory, or an index an earlier build wrote (it is
    rebuilt). The index's files (corpus.jsonl among them) would overwrite what a directory of the user's
    holds, so anything else is refused, and so is a corpus inside the directory; ValueError says which."""
    if not str(out_dir).strip():
        raise ValueError(f"--out {str(out_dir)!r} is empty: name the index directory to write (a new one)")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory: name a new directory for the index")
    if source and Path(source).expanduser().resolve().is_relative_to(out.resolve()):
        raise ValueError(f"--corpus {source} is inside --out {out}, where the index writes its own corpus.jsonl: "
                         "name an index directory that does not hold the corpus")
    if out.is_dir() and any(out.iterdir()) and not (out / META_FILE).is_file():
        raise ValueError(f"--out {out} is a directory with files of its own (no {META_FILE}: not an index an "
                         "earlier build wrote), which the index's files would overwrite: name a new directory")
    return out


class BM25Index:
    """A loaded index: `search(query, k)` -> ranked hits. Thread-safe (one lock around the lookup,
    because the memory-mapped corpus reader shares a file handle)."""

    def __init__(self, retriever, tokenizer, meta: dict):
        self._retriever, self._tokenizer, self.meta = retriever, tokenizer, meta
        self._lock = threading.Lock()

    @property
    def documents(self) -> int:
        return int(self.meta["documents"])

    @classmethod
    def build(cls, docs: Iterable[dict[str, str]], source: str = "") -> BM25Index:
        """Index documents ({"id", "title", "text"}); the title is indexed with the text."""
        import bm25s

        docs = list(docs)
        if not docs:
            raise ValueError("the corpus is empty: nothing to index (check --corpus)")
        tok = _tokenizer()
        tokens = tok.tokenize([f"{d['title']} {d['text']}" for d in docs], update_vocab=True,
                              return_as="tuple", show_progress=False)
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        retriever.corpus = docs
        meta = {"format": INDEX_FORMAT, "documents": len(docs), "source": source, "built_at": time.time(),
                "tokenizer": {"splitter": SPLITTER, "stopwords": "en", "lower": True}}
        return cls(retriever, tok, meta)

    def save(self, out_dir: str | Path) -> Path:
        out = check_out_dir(out_dir, self.meta.get("source") or None)
        out.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(out), corpus=self._retriever.corpus, show_progress=False)
        self._tokenizer.save_vocab(str(out))
        self._tokenizer.save_stopwords(str(out))
        (out / META_FILE).write_text(json.dumps(self.meta, indent=2))  # written last: marks a complete index
        return out

    @classmethod
    def load(cls, index_dir: str | Path, mmap: bool = True) -> BM25Index:
        import bm25s

        d = Path(index_dir)
        if not (d / META_FILE).exists():
            raise ValueError(f"--index {str(d)!r} is not a built index (no {META_FILE}); build it first with "
                             "`python -m infra.retriever build --corpus <pubmed.jsonl> --out <dir>`")
        meta = json.loads((d / META_FILE).read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"index {d} has format {meta.get('format')!r}; this code reads {INDEX_FORMAT}: rebuild it")
        retriever = bm25s.BM25.load(str(d), load_corpus=True, mmap=mmap, show_progress=False)
        tok = _tokenizer()
        tok.load_vocab(str(d))
        tok.load_stopwords(str(d))
        return cls(retriever, tok, meta)

    def search(self, query: str, k: int) -> list[SearchHit]:
        k = min(k, self.documents)
        with self._lock:
            q = self._tokenizer.tokenize([query], update_vocab=False, return_as="tuple", show_progress=False)
            docs, scores = self._retriever.retrieve(q, k=k, show_progress=False, n_threads=1)
        hits = []
        for doc, score in zip(docs[0], scores[0], strict=True):
            if float(score) <= 0.0:  # no query word occurs in it: not a match
                continue
            hits.append(SearchHit(id=str(doc["id"]), title=str(doc.get("title", "")),
                                  text=str(doc.get("text", "")), score=float(score)))
        return hits
