"""Corpus loaders: the real PaperSearchQA search corpus, and a small generated one.

The real corpus is `jmhb/pubmed_bioasq_2022` (about 23 million PubMed abstracts up to 2022). Its
retrieval form, `data/corpus/pubmed.jsonl`, has one {"id": <row>, "contents": "TITLE: <t>. ABSTRACT: <a>"}
object per line. We also read rows with separate fields ({"title", "abstract"|"abstractText"|"text",
"pmid"|"id"}) and Search-R1's `"<title>"\\n<text>` contents, so any of the published forms works.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

HF_CORPUS = "jmhb/pubmed_bioasq_2022"
HF_CORPUS_FILE = "data/corpus/pubmed.jsonl"

_TITLE_ABSTRACT = re.compile(r"^\s*TITLE:\s*(?P<title>.*?)\s*ABSTRACT:\s*(?P<text>.*)$", re.DOTALL)


def parse_row(row: dict, line_no: int) -> dict[str, str]:
    """One corpus row as {"id", "title", "text"}."""
    doc_id = row.get("pmid", row.get("PMID", row.get("id", line_no)))
    if "contents" in row:
        contents = str(row["contents"])
        m = _TITLE_ABSTRACT.match(contents)
        if m:
            title, text = m.group("title").rstrip(". "), m.group("text")
        elif "\n" in contents:
            title, text = contents.split("\n", 1)
            title = title.strip().strip('"')
        else:
            title, text = "", contents
    else:
        title = str(row.get("title") or "")
        text = str(row.get("abstract") or row.get("abstractText") or row.get("text") or "")
    if not (title or text).strip():
        raise ValueError(f"corpus line {line_no}: no title or text (keys: {sorted(row)})")
    return {"id": str(doc_id), "title": title.strip(), "text": text.strip()}


def iter_jsonl(path: str | Path, limit: int | None = None) -> Iterator[dict[str, str]]:
    """Stream documents from a JSONL corpus file (never loads the file whole); a line that is not a JSON
    object, or a file that is not UTF-8 text, is a ValueError naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        n = 0
        try:
            for line_no, line in enumerate(f):
                if limit is not None and n >= limit:
                    return
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no + 1} is not JSON ({e.msg}): the corpus is JSONL, one "
                                     "object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{line_no + 1} is a JSON {type(row).__name__}, not an object: the corpus "
                                     'is JSONL, one {"id", "contents"} or {"title", "abstract"} object per line')
                yield parse_row(row, line_no)
                n += 1
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text: the corpus is JSONL, one JSON object per line") from None


def download_corpus(cache_dir: str | None = None, revision: str | None = None) -> Path:
    """Fetch the real corpus file (about 23 GB) through huggingface_hub on the box that builds the index."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ValueError("downloading the PubMed corpus needs huggingface_hub (pip install huggingface_hub); "
                         "or pass --corpus /path/to/pubmed.jsonl") from None
    return Path(hf_hub_download(HF_CORPUS, HF_CORPUS_FILE, repo_type="dataset", revision=revision,
                                cache_dir=cache_dir))


# Word pools for the generated corpus: gene/protein names, verbs and contexts, so queries built from a
# document's own words have one clearly best match (tests assert the ranking, not just a 200).
_GENES = ["dystrophin", "cftr", "brca1", "tp53", "egfr", "kras", "hbb", "apoe", "mecp2", "fmr1", "htt",
          "pten", "myc", "vegfa", "il6", "tnf", "insulin", "leptin", "titin", "actin"]
_VERBS = ["regulates", "binds", "inhibits", "activates", "encodes", "stabilizes", "cleaves", "transports"]
_CONTEXTS = ["muscle fibres", "lung epithelium", "breast tissue", "neurons", "hepatocytes", "t cells",
             "cardiomyocytes", "adipocytes", "retina", "kidney tubules", "bone marrow", "skin"]


def synthetic_corpus(n: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """A small generated corpus of abstract-like documents with ids `syn-<i>`."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        gene, other = rng.sample(_GENES, 2)
        verb, ctx = rng.choice(_VERBS), rng.choice(_CONTEXTS)
        marker = f"marker{i:05d}"  # one word unique to this document
        title = f"{gene.upper()} {verb} {other.upper()} in {ctx}"
        text = (f"We show that {gene} {verb} {other} in {ctx}. The effect depends on {marker} and was "
                f"measured in {rng.randint(10, 500)} samples.")
        docs.append({"id": f"syn-{i}", "title": title, "text": text})
    return docs


def write_jsonl(docs: list[dict[str, str]], path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"pmid": d["id"], "title": d["title"], "abstract": d["text"]}) + "\n")
    return path
