"""BM25 retriever: index on a generated corpus, real HTTP server on 127.0.0.1, the client, the CLI and the
Invoke task (dry run and a real served process stopped with SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra.retriever.corpus import iter_jsonl, parse_row, synthetic_corpus, write_jsonl
from infra.retriever.index import BM25Index
from infra.retriever.server import make_server
from worker_contract.tasks.psqa_retrieval import RetrieverClient, RetrieverError, format_hits, search_tool

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def docs():
    return synthetic_corpus(120, seed=3)


@pytest.fixture(scope="module")
def server(docs, tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    BM25Index.build(docs, source="generated").save(d)
    srv = make_server(BM25Index.load(d), "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _post(url, body: bytes):
    req = urllib.request.Request(url + "/search", data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_parse_row_forms():
    assert parse_row({"id": 7, "contents": "TITLE: Dystrophin in muscle. ABSTRACT: It binds actin."}, 0) == \
        {"id": "7", "title": "Dystrophin in muscle", "text": "It binds actin."}
    assert parse_row({"contents": '"A title"\nbody text'}, 3) == {"id": "3", "title": "A title", "text": "body text"}
    assert parse_row({"pmid": 12, "title": "T", "abstractText": "A"}, 0) == {"id": "12", "title": "T", "text": "A"}
    with pytest.raises(ValueError, match="line 5"):
        parse_row({"title": "", "abstract": ""}, 5)


def test_health_and_ranked_search(server, docs):
    client = RetrieverClient(server.url)
    h = client.health()
    assert h.status == "ok" and h.documents == len(docs) and h.corpus == "generated"
    target = docs[42]
    marker = target["text"].split("depends on ")[1].split()[0]
    res = client.search(f"{marker} {target['title']}", k=5)
    assert res.hits[0].id == target["id"] and res.hits[0].title == target["title"]
    assert [h.score for h in res.hits] == sorted((h.score for h in res.hits), reverse=True)
    assert len(res.hits) <= 5 and all(h.score > 0 for h in res.hits)
    assert "Doc 1 (Title: " in format_hits(res.hits)
    # a query of unknown words matches nothing rather than returning arbitrary documents
    assert client.search("zzzz qqqq", k=3).hits == []
    # k larger than the corpus is clamped
    assert len(client.search("dystrophin", k=50).hits) <= len(docs)


def test_bad_requests_are_400_with_a_reason(server):
    code, body = _post(server.url, b'{"query": "", "k": 3}')
    assert code == 400 and "query" in body["error"]
    code, body = _post(server.url, b'{"query": "x", "k": 0}')
    assert code == 400 and "k" in body["error"]
    code, body = _post(server.url, b"not json")
    assert code == 400
    code, body = _post(server.url, b'{"query": "x", "k": 3, "extra": 1}')
    assert code == 400 and "extra" in body["error"]
    with pytest.raises(RetrieverError, match="404"):
        RetrieverClient(server.url)._call("GET", "/nope")


def test_concurrent_searches(server, docs):
    client = RetrieverClient(server.url)
    errors, results = [], {}

    def worker(i):
        try:
            marker = docs[i]["text"].split("depends on ")[1].split()[0]
            results[i] = client.search(marker, k=1).hits[0].id
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {i: docs[i]["id"] for i in range(16)}


def test_client_errors_and_search_tool(server, docs):
    with pytest.raises(ValueError, match="DRL_RETRIEVER_URL"):
        RetrieverClient("localhost:8000")
    dead = RetrieverClient("http://127.0.0.1:9", timeout_s=2)  # discard port: refused
    with pytest.raises(RetrieverError):
        dead.health()
    assert search_tool(dead)("dystrophin").startswith("Search failed (")
    text = search_tool(RetrieverClient(server.url), k=2)(docs[5]["title"])
    assert text.startswith("Doc 1 (Title: ") and "Doc 3" not in text


def test_load_refuses_a_non_index(tmp_path):
    with pytest.raises(ValueError, match="not a built index"):
        BM25Index.load(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        BM25Index.build([])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_invoke_task_dry_run_and_real_process(tmp_path):
    corpus = write_jsonl(synthetic_corpus(30, seed=1), tmp_path / "c.jsonl")
    assert len(list(iter_jsonl(corpus))) == 30 and len(list(iter_jsonl(corpus, limit=4))) == 4
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "invoke", "retriever", "--corpus", str(corpus), "--dry-run"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "DRY RUN:" in out.stdout and "infra.retriever serve --host 127.0.0.1 --port 8000" in out.stdout
    idx = tmp_path / "idx"
    out = subprocess.run([sys.executable, "-m", "infra.retriever", "build", "--corpus", str(corpus), "--out", str(idx)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "indexed 30 documents" in out.stdout, out.stderr
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "retriever", "--index", str(idx), "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                assert RetrieverClient(url, timeout_s=2).health().documents == 30
                break
            except RetrieverError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "retriever did not come up"
                time.sleep(0.3)
        st = subprocess.run([sys.executable, "-m", "invoke", "retriever.status", "--url", url],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "30 documents" in st.stdout, st.stderr
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    assert proc.returncode == 0


def _cli(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "infra.retriever", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_build_and_generate_never_overwrite_the_users_files(tmp_path):
    """`build --corpus corpus.jsonl --out .` once rewrote the user's corpus in place (the index writes its own
    corpus.jsonl); an existing file, '' and a directory of the user's are refused the same way, each in one
    sentence with exit 2, the files unchanged. A directory an earlier build wrote is rebuilt."""
    docs = [{**d, "id": f"pmid-{i}"} for i, d in enumerate(synthetic_corpus(12, seed=2))]  # the user's own
    corpus = write_jsonl(docs, tmp_path / "corpus.jsonl")
    original = corpus.read_bytes()
    (tmp_path / "notes.txt").write_text("mine")
    for out, says in ((".", "inside --out"), ("notes.txt", "is a file"), ("", "is empty"),
                      (str(tmp_path), "inside --out")):
        r = _cli("build", "--corpus", "corpus.jsonl", "--out", out, cwd=tmp_path)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (out, r.stderr)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "corpus.jsonl").write_text("the user's other file\n")
    r = _cli("build", "--corpus", "corpus.jsonl", "--out", "mine", cwd=tmp_path)
    assert r.returncode == 2 and "files of its own" in r.stderr, r.stderr
    assert (mine / "corpus.jsonl").read_text() == "the user's other file\n"
    for out in ("corpus.jsonl", "notes.txt", "", "mine"):  # generate overwrites only a corpus it wrote
        r = _cli("generate", "--out", out, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (out, r.stderr)
    assert corpus.read_bytes() == original and (tmp_path / "notes.txt").read_text() == "mine"
    assert _cli("generate", "--out", "gen.jsonl", cwd=tmp_path).returncode == 0
    assert _cli("generate", "--out", "gen.jsonl", "--docs", "20", cwd=tmp_path).returncode == 0  # its own: again
    for _ in range(2):  # a new directory, then the index it wrote: rebuilt
        r = _cli("build", "--corpus", "corpus.jsonl", "--out", "idx", cwd=tmp_path)
        assert r.returncode == 0 and "indexed 12 documents" in r.stdout, r.stderr
    assert corpus.read_bytes() == original
