"""`python -m infra.retriever {build,serve,generate}`: build the BM25 index, serve it, or write a small
generated corpus for a smoke run. The Invoke task `retriever` (infra/retriever_tasks.py) calls `main`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from worker_contract.cli import number


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra.retriever", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="index a JSONL corpus and save it to --out")
    b.add_argument("--corpus", help="JSONL corpus; omit with --download to fetch the real PubMed corpus")
    b.add_argument("--download", action="store_true", help="fetch jmhb/pubmed_bioasq_2022 (about 23 GB)")
    b.add_argument("--out", required=True, help="index directory to write")
    b.add_argument("--limit", type=number(int, at_least=1), default=None, help="index only the first N documents")
    s = sub.add_parser("serve", help="serve a built index (or build one from --corpus in memory)")
    s.add_argument("--index", help="index directory written by `build`")
    s.add_argument("--corpus", help="JSONL corpus to index in memory instead (small corpora)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 to serve the fleet)")
    s.add_argument("--port", type=number(int, at_least=0, at_most=65535, hint="0: any free port"), default=8000,
                   help="TCP port (default 8000; 0 = any free port)")
    g = sub.add_parser("generate", help="write a small generated corpus (JSONL)")
    g.add_argument("--out", required=True, help="the JSONL file to write (it overwrites only a corpus it wrote)")
    g.add_argument("--docs", type=number(int, at_least=1), default=200, help="abstracts to write (default 200)")
    g.add_argument("--seed", type=number(int, at_least=0), default=0, help="seed of the generated text (default 0)")
    return p


def _generated(path: str) -> bool:
    """Whether `path` starts as a corpus `generate` wrote (its first id `syn-0`), the one file it overwrites."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith('{"pmid": "syn-0"')
    except (OSError, UnicodeDecodeError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from . import corpus

    if args.cmd == "generate":
        if not args.out.strip() or Path(args.out).is_dir() or (Path(args.out).exists() and not _generated(args.out)):
            raise ValueError(f"--out {args.out!r} is a directory, empty, or a file generate did not write: it "
                             "overwrites only its own corpus (name a new file, e.g. --out generated.jsonl)")
        path = corpus.write_jsonl(corpus.synthetic_corpus(args.docs, args.seed), args.out)
        print(f"wrote {args.docs} documents to {path}")
        return 0
    from .index import BM25Index, check_out_dir

    if args.cmd == "build":
        if not args.corpus and not args.download:
            raise ValueError("build needs --corpus PATH or --download")
        if args.corpus and not Path(args.corpus).is_file():
            raise ValueError(f"--corpus {args.corpus} is not a file (a JSONL corpus, one document a line)")
        check_out_dir(args.out, args.corpus)  # before hours of indexing, and before a download
        path = args.corpus or str(corpus.download_corpus())
        index = BM25Index.build(corpus.iter_jsonl(path, args.limit), source=path)
        out = index.save(args.out)
        print(f"indexed {index.documents} documents from {path} into {out}")
        return 0
    from .server import check_bind, serve

    if bool(args.index) == bool(args.corpus):
        raise ValueError("serve needs exactly one of --index DIR or --corpus PATH")
    if not 0 <= args.port < 65536:  # 0: any free port, the one bound is printed
        raise ValueError(f"--port {args.port} is out of range 0-65535 (0: any free port)")
    for flag, path in (("--index", args.index), ("--corpus", args.corpus)):
        if path and not Path(path).exists():
            raise ValueError(f"{flag} {path} does not exist")
    check_bind(args.host, args.port)  # before the index is loaded or built for it
    index = (BM25Index.load(args.index) if args.index
             else BM25Index.build(corpus.iter_jsonl(args.corpus), source=args.corpus))
    serve(index, args.host, args.port)
    return 0


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m infra.retriever"))
