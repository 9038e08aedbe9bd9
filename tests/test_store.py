"""Store semantics on both backends (file and S3 over real HTTP to moto), and the S3 client's reliability
behaviour under injected faults, proven by counting requests at the fault proxy."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from worker_contract.store import NotFound, PreconditionFailed, StoreError, open_store
from worker_contract.store.s3 import MiB, S3Store


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


@pytest.fixture
def proxied(moto_server, s3_bucket, fault_proxy):
    """(store, proxy): an S3Store whose every request passes the fault proxy.

    The read timeout is generous so that a loaded machine's slow moto never adds a timeout retry to the
    exact request sequences these tests count; the slow-answer test sets a short one itself.
    """
    store = S3Store.from_url(f"s3://{s3_bucket}", moto_server.env(endpoint=fault_proxy.url),
                             read_timeout=15.0, connect_timeout=5.0, part_size=5 * MiB)
    return store, fault_proxy


# -- every operation, both backends -----------------------------------------------------------------
def test_put_get_head_delete(store):
    etag = store.put("r/a.bin", b"one")
    assert etag == _md5(b"one")
    assert store.get("r/a.bin") == b"one"
    assert store.get_with_etag("r/a.bin") == (b"one", etag)
    info = store.head("r/a.bin")
    assert (info.key, info.size, info.etag) == ("r/a.bin", 3, etag)
    assert store.exists("r/a.bin")
    assert store.put("r/a.bin", b"two!") == _md5(b"two!")  # plain put overwrites
    assert store.get("r/a.bin") == b"two!"
    store.delete("r/a.bin")
    assert store.head("r/a.bin") is None and not store.exists("r/a.bin")
    store.delete("r/a.bin")  # deleting an absent key is not an error


def test_missing_key_is_not_found(store, tmp_path):
    for call in (lambda: store.get("r/none"), lambda: store.get_with_etag("r/none"),
                 lambda: store.open_read("r/none"), lambda: store.download_file("r/none", tmp_path / "x")):
        with pytest.raises(NotFound, match="r/none"):
            call()
    assert not (tmp_path / "x").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_create_only(store):
    store.put_if_absent("r/run.json", b"first")
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("r/run.json", b"second")
    assert store.get("r/run.json") == b"first"


def test_compare_and_swap(store):
    etag = store.put("r/current.json", b"v1")
    etag2 = store.put_if_match("r/current.json", b"v2", etag)
    assert etag2 == _md5(b"v2") and store.get("r/current.json") == b"v2"
    with pytest.raises(PreconditionFailed):
        store.put_if_match("r/current.json", b"v3", etag)  # stale ETag
    assert store.get("r/current.json") == b"v2"
    assert store.put_if_match("r/current.json", b"v3", f'"{etag2}"') == _md5(b"v3")  # quoted form too
    with pytest.raises(NotFound):
        store.put_if_match("r/absent.json", b"x", etag)


def test_list_order_prefix_start_after(store):
    keys = ["r/b/2", "r/a/1", "r/b/10", "r/c", "s/x", "r/b/1"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list_keys("r/") == sorted(k for k in keys if k.startswith("r/"))
    assert store.list_keys("r/b/") == ["r/b/1", "r/b/10", "r/b/2"]
    assert store.list_keys("r/", start_after="r/b/10") == ["r/b/2", "r/c"]
    assert store.list_keys("r/b") == ["r/b/1", "r/b/10", "r/b/2"]  # a prefix need not end at a slash
    assert store.list_keys("q/") == []
    infos = list(store.list("r/a/"))
    assert [(i.key, i.size, i.etag) for i in infos] == [("r/a/1", 5, _md5(b"r/a/1"))]


# The two races below run on the file store: moto alone checks a condition and then writes, not atomically,
# so on a loaded box two racers can both pass its check. The S3 store races them in tests/test_store_r2.py,
# on a server that holds the key while it writes, as R2 does.
def test_create_only_race_has_one_winner(file_store):
    store = file_store
    barrier = threading.Barrier(16)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            store.put_if_absent("race/key", f"writer-{i}".encode())
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(16) as pool:
        won = list(pool.map(attempt, range(16)))
    assert won.count(True) == 1
    assert store.get("race/key") == f"writer-{won.index(True)}".encode()


def test_cas_race_has_one_winner(file_store):
    store = file_store
    etag = store.put("race/ptr", b"v0")
    barrier = threading.Barrier(8)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            store.put_if_match("race/ptr", f"v{i + 1}".encode(), etag)
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(attempt, range(8)))
    assert won.count(True) == 1
    assert store.get("race/ptr") == f"v{won.index(True) + 1}".encode()


def test_2500_keys_page_with_start_after(store):
    keys = [f"run/rollouts/v{i // 500:010d}/w/{i:05d}.json.zst" for i in range(2500)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    assert store.list_keys("run/") == keys
    assert store.list_keys("run/", start_after=keys[1234]) == keys[1235:]
    assert store.list_keys("run/", start_after=keys[-1]) == []
    assert store.list_keys(f"run/rollouts/v{2:010d}/") == keys[1000:1500]


def test_upload_download_stream(store, tmp_path):
    src = tmp_path / "src.bin"
    data = os.urandom(300_000)
    src.write_bytes(data)
    assert store.upload_file("r/blob", src) == _md5(data)
    with pytest.raises(PreconditionFailed):
        store.upload_file("r/blob", src, if_absent=True)
    assert store.upload_file("r/blob2", src, if_absent=True) == _md5(data)
    dest = tmp_path / "out" / "dest.bin"
    store.download_file("r/blob2", dest)
    assert dest.read_bytes() == data
    with store.open_read("r/blob") as f:
        chunks = iter(lambda: f.read(65536), b"")
        assert b"".join(chunks) == data


# -- S3 specifics ---------------------------------------------------------------------------------------
def test_multipart_equal_parts_and_streaming(proxied, tmp_path):
    store, proxy = proxied
    src = tmp_path / "big.bin"
    data = os.urandom(11 * MiB + 123)  # parts of 5 MiB, 5 MiB, 1 MiB + 123 bytes
    src.write_bytes(data)
    for key, if_absent in (("big/managed", False), ("big/create-only", True)):
        proxy.clear()
        etag = store.upload_file(key, src, if_absent=if_absent)
        sizes = [r.length for r in proxy.requests("PUT", query="partNumber=")]
        assert sorted(sizes, reverse=True) == [5 * MiB, 5 * MiB, MiB + 123], key
        assert etag.endswith("-3") and store.head(key).size == len(data)
        if if_absent:  # the condition rides on CompleteMultipartUpload
            assert proxy.requests("POST", query="uploadId=")[0].headers.get("if-none-match") == "*"
        dest = tmp_path / f"{key.replace('/', '_')}.out"
        store.download_file(key, dest)
        assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(data).digest()
    with store.open_read("big/create-only") as body:
        h, n = hashlib.sha256(), 0
        for chunk in iter(lambda: body.read(MiB), b""):
            h.update(chunk)
            n += 1
    assert h.digest() == hashlib.sha256(data).digest() and n >= 11


def test_multipart_create_only_refused_and_aborted(proxied, tmp_path, moto_server):
    store, proxy = proxied
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(6 * MiB))
    store.upload_file("big/x", src, if_absent=True)
    src.write_bytes(os.urandom(6 * MiB))
    proxy.clear()
    with pytest.raises(PreconditionFailed):
        store.upload_file("big/x", src, if_absent=True)
    assert proxy.requests("PUT") == []  # refused before sending any part
    uploads = moto_server.client().list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert uploads == []


def test_no_checksum_trailers_on_the_wire(proxied):
    store, proxy = proxied
    store.put("w/a", b"payload")
    store.get("w/a")
    for r in proxy.requests():
        assert not any(h.startswith("x-amz-checksum") or h == "x-amz-sdk-checksum-algorithm" for h in r.headers)
        assert r.headers.get("content-encoding") != "aws-chunked"
    assert proxy.requests("PUT")[0].headers["content-md5"]


def test_injected_503_and_429_are_retried(proxied):
    store, proxy = proxied
    proxy.inject(["503", "429", "503"], match=lambda r: r.method == "PUT")
    assert store.put("f/a", b"data") == _md5(b"data")
    assert [r.fault for r in proxy.requests("PUT")] == ["503", "429", "503", None]
    proxy.clear()
    proxy.rate, proxy.kinds = 0.3, ("503", "429", "reset")
    for i in range(12):
        store.put(f"f/k{i:02d}", str(i).encode())
        assert store.get(f"f/k{i:02d}") == str(i).encode()
    assert store.list_keys("f/k") == [f"f/k{i:02d}" for i in range(12)]
    faults = [r.fault for r in proxy.requests() if r.fault]  # seeded: the same faults every run
    assert len(faults) >= 5 and {"503", "429", "reset"} <= set(faults)


def test_precondition_failure_is_not_retried(proxied):
    store, proxy = proxied
    store.put_if_absent("p/run.json", b"a")
    etag = store.put("p/ptr", b"v1")
    store.put("p/ptr", b"v2")
    proxy.clear()
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("p/run.json", b"b")
    with pytest.raises(PreconditionFailed):
        store.put_if_match("p/ptr", b"v3", etag)
    assert [(r.method, r.status) for r in proxy.requests()] == [("PUT", 412), ("PUT", 412)]


def test_racing_writer_429_then_412_is_an_answer(proxied):
    """R2 answers a writer racing another on one key with 429: retried, then the 412 is the answer."""
    store, proxy = proxied
    store.put_if_absent("p/key", b"winner")
    proxy.clear()
    proxy.inject(["429", "429"], match=lambda r: r.method == "PUT")
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("p/key", b"loser")
    assert [(r.method, r.status) for r in proxy.requests()] == [("PUT", 429), ("PUT", 429), ("PUT", 412),
                                                                ("HEAD", 200)]
    assert store.get("p/key") == b"winner"


def test_lost_answer_of_a_conditional_write_is_recognised(proxied):
    store, proxy = proxied
    proxy.inject(["lost"], match=lambda r: r.method == "PUT")
    assert store.put_if_absent("l/run.json", b"mine") == _md5(b"mine")
    assert [(r.method, r.fault, r.status) for r in proxy.requests("PUT")] == [("PUT", "lost", 200),
                                                                             ("PUT", None, 412)]
    etag = store.put("l/ptr", b"v1")
    proxy.inject(["lost"], match=lambda r: r.method == "PUT")
    assert store.put_if_match("l/ptr", b"v2", etag) == _md5(b"v2")
    assert store.get("l/ptr") == b"v2"


def test_slow_answer_times_out_and_is_retried(proxied, moto_server, s3_bucket):
    _, proxy = proxied
    # a read timeout a loaded 2-core box answers within (0.5 s once timed the retry out too), and an answer
    # held three times longer
    store = S3Store.from_url(f"s3://{s3_bucket}", moto_server.env(endpoint=proxy.url),
                             read_timeout=2.0, connect_timeout=1.0)
    proxy.slow_s = 6.0
    proxy.inject(["slow"], match=lambda r: r.method == "GET")
    store.put("s/a", b"x")
    assert store.get("s/a") == b"x"
    assert [r.fault for r in proxy.requests("GET")] == ["slow", None]


def test_retries_give_up_with_a_store_error(moto_server, s3_bucket, fault_proxy):
    store = S3Store.from_url(f"s3://{s3_bucket}", moto_server.env(endpoint=fault_proxy.url), max_attempts=3)
    fault_proxy.rate, fault_proxy.kinds = 1.0, ("503",)
    with pytest.raises(StoreError) as err:
        store.put("g/a", b"x")
    assert not isinstance(err.value, (NotFound, PreconditionFailed))
    assert "503" in str(err.value) and len(fault_proxy.requests("PUT")) == 3


# -- opening stores -------------------------------------------------------------------------------------
def test_r2_url_builds_the_r2_client():
    env = {"R2_ACCOUNT_ID": "0123456789abcdef0123456789abcdef", "R2_ACCESS_KEY_ID": "k" * 32,
           "R2_SECRET_ACCESS_KEY": "s" * 64}
    store = open_store("r2://my-bucket", env)
    assert isinstance(store, S3Store) and store.url == "r2://my-bucket"
    assert store.endpoint == "https://0123456789abcdef0123456789abcdef.r2.cloudflarestorage.com"
    meta = store._client.meta
    assert meta.region_name == "auto" and meta.endpoint_url == store.endpoint
    assert meta.config.request_checksum_calculation == "when_required"
    assert meta.config.response_checksum_validation == "when_required"
    assert meta.config.retries == {"mode": "standard", "total_max_attempts": 8}
    eu = open_store("r2://my-bucket", {**env, "R2_JURISDICTION": "eu"})
    assert eu.endpoint.endswith(".eu.r2.cloudflarestorage.com")


@pytest.mark.parametrize("url, env, match", [
    ("r2://my-bucket", {"R2_ACCOUNT_ID": "abc"}, "R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY"),
    ("r2://my-bucket", {"R2_ACCOUNT_ID": "x/evil", "R2_ACCESS_KEY_ID": "k", "R2_SECRET_ACCESS_KEY": "s"},
     "R2_ACCOUNT_ID"),
    ("s3://Bad_Bucket", {}, "not a valid bucket name"),
    ("s3://bucket/some/path", {}, "no path"),
    ("s3://bucket", {"DRL_S3_ENDPOINT": "localhost:9000"}, "DRL_S3_ENDPOINT"),
    ("gs://bucket", {}, "unknown store scheme"),
])
def test_bad_store_urls_are_refused(url, env, match):
    with pytest.raises(ValueError, match=match):
        open_store(url, env)


def test_credentials_in_url_are_refused_without_echo():
    with pytest.raises(ValueError) as err:
        open_store("s3://AKIAXYZ:hunter2secret@bucket", {})
    assert "hunter2secret" not in str(err.value) and "AKIAXYZ" not in str(err.value)
