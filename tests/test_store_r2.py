"""The store against R2's semantics (tests/r2_server.py: moto behind R2's rules), beside the moto runs of
tests/test_store.py: conditional writes under races (429, then 412), listing, ranged reads and multipart
uploads; a publisher that loses the race on the pointer and a second writer of an anchor behave as the
contract says (docs/contract.md)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from r2_server import R2Server

from worker_contract import layout, signing
from worker_contract.anchor import VersionTaken, read_anchor, write_anchor
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, read_pointer
from worker_contract.store import PreconditionFailed
from worker_contract.store.s3 import MiB, S3Store

pytestmark = pytest.mark.integration
ACCESS, SECRET = "r2-test-access", "r2-test-secret"


@pytest.fixture(scope="module")
def r2():
    server = R2Server().start()
    yield server
    server.stop()


def _client(endpoint: str, attempts: int = 5):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS,
                        aws_secret_access_key=SECRET,
                        config=Config(retries={"mode": "standard", "max_attempts": attempts}))


@pytest.fixture
def r2_store(r2):
    bucket = r2.new_bucket(_client(r2.endpoint))
    env = {"DRL_S3_ENDPOINT": r2.endpoint, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": ACCESS,
           "AWS_SECRET_ACCESS_KEY": SECRET}
    r2.rules.seen.clear()
    return S3Store.from_url(f"s3://{bucket}", env, part_size=5 * MiB, read_timeout=30.0)


class _HeldWrite:
    """A create-only PUT of `size` bytes sent by hand: headers and half the body go now, the rest when
    `finish()` is called, so the server is inside this write (the key held) for as long as the test likes."""

    def __init__(self, endpoint: str, bucket: str, key: str, size: int = 2 * MiB):
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(endpoint)
        self.size, self.body = size, os.urandom(size)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self.conn.putrequest("PUT", f"/{bucket}/{key}", skip_accept_encoding=True)
        self.conn.putheader("Content-Length", str(size))
        self.conn.putheader("If-None-Match", "*")
        self.conn.endheaders()
        self.conn.send(self.body[: size // 2])

    def finish(self) -> int:
        self.conn.send(self.body[self.size // 2:])
        resp = self.conn.getresponse()
        resp.read()
        self.conn.close()
        return resp.status


def test_the_server_enforces_what_moto_alone_does_not(r2, r2_store, moto_server, tmp_path):
    """The rules can fail: a write arriving while another write of the same key is in flight gets 429 (the
    first write is held open by hand, so the overlap is certain, not a matter of thread timing); unequal parts
    are refused at CompleteMultipartUpload (moto alone takes both)."""
    raw = _client(r2.endpoint, attempts=1)
    bucket = r2_store.bucket
    barrier = threading.Barrier(12)

    def put() -> int:
        try:
            raw.put_object(Bucket=bucket, Key="k", Body=os.urandom(64 * 1024), IfNoneMatch="*")
            return 200
        except raw.exceptions.ClientError as e:
            return e.response["ResponseMetadata"]["HTTPStatusCode"]

    def racing(i: int) -> int:
        barrier.wait()
        return put()

    held = _HeldWrite(r2.endpoint, bucket, "k")
    try:
        deadline = time.monotonic() + 30
        while not r2.rules.holding(bucket, "k"):
            assert time.monotonic() < deadline, "the held write never reached the server"
            time.sleep(0.005)
        with ThreadPoolExecutor(12) as pool:  # twelve racers while the key is held: each is told 429
            codes = list(pool.map(racing, range(12)))
        assert r2.rules.holding(bucket, "k"), "the held write ended early: the racers did not race it"
        assert codes == [429] * 12, codes
        assert held.finish() == 200  # the held write lands; a create-only write after it is told 412
    finally:
        held.conn.close()
    assert put() == 412
    assert raw.get_object(Bucket=bucket, Key="k")["Body"].read() == held.body

    def unequal(client, bkt):
        up = client.create_multipart_upload(Bucket=bkt, Key="mpu")["UploadId"]
        parts = [{"PartNumber": n, "ETag": client.upload_part(Bucket=bkt, Key="mpu", UploadId=up, PartNumber=n,
                                                              Body=b"x" * size)["ETag"]}
                 for n, size in ((1, 5 * MiB), (2, 6 * MiB), (3, 10))]
        return client.complete_multipart_upload(Bucket=bkt, Key="mpu", UploadId=up, MultipartUpload={"Parts": parts})

    with pytest.raises(raw.exceptions.ClientError, match="InvalidPart"):
        unequal(raw, bucket)
    plain = moto_server.client()
    assert unequal(plain, moto_server.new_bucket())["ETag"]  # moto takes them: the rule is the layer's


def test_create_only_race_one_winner_losers_told_412(r2, r2_store):
    barrier = threading.Barrier(16)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            r2_store.put_if_absent("race/key", f"writer-{i}".encode() * 50_000)
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(16) as pool:
        won = list(pool.map(attempt, range(16)))
    assert won.count(True) == 1
    assert r2_store.get("race/key") == f"writer-{won.index(True)}".encode() * 50_000
    puts = r2.rules.statuses("PUT")
    assert puts.count(200) == 1 and 412 in puts and set(puts) <= {200, 412, 429}, puts


def test_compare_and_swap_race_one_winner(r2_store):
    etag = r2_store.put("race/ptr", b"v0")
    barrier = threading.Barrier(8)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            r2_store.put_if_match("race/ptr", f"v{i + 1}".encode(), etag)
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(attempt, range(8)))
    assert won.count(True) == 1 and r2_store.get("race/ptr") == f"v{won.index(True) + 1}".encode()


def test_listing_pages_with_start_after(r2_store):
    keys = [f"run/rollouts/v{i // 400:010d}/w/{i:05d}.json.zst" for i in range(1200)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: r2_store.put(k, b"x"), keys))
    assert r2_store.list_keys("run/") == keys  # two pages of at most 1000
    assert r2_store.list_keys("run/", start_after=keys[999]) == keys[1000:]
    assert r2_store.list_keys(f"run/rollouts/v{1:010d}/") == keys[400:800]


def test_multipart_create_only_race_and_ranged_reads(r2, r2_store, tmp_path):
    """Two create-only uploads of 11 MiB race for one key: equal 5 MiB parts, the condition on Complete;
    exactly one lands and the other is told PreconditionFailed, its upload aborted. The download reads it
    back in ranges."""
    srcs = []
    for i in range(2):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(os.urandom(11 * MiB + 7))
        srcs.append(p)
    barrier = threading.Barrier(2)

    def upload(p) -> str | None:
        barrier.wait()
        try:
            return r2_store.upload_file("big/anchor", p, if_absent=True)
        except PreconditionFailed:
            return None

    with ThreadPoolExecutor(2) as pool:
        etags = list(pool.map(upload, srcs))
    assert sum(e is not None for e in etags) == 1, etags
    winner = srcs[[e is not None for e in etags].index(True)]
    dest = tmp_path / "dest.bin"
    r2.rules.seen.clear()
    r2_store.download_file("big/anchor", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(winner.read_bytes()).digest()
    ranges = [s.headers["range"] for s in r2.rules.seen if s.method == "GET" and "range" in s.headers]
    assert len(ranges) >= 2 and all(s.status == 206 for s in r2.rules.seen if "range" in s.headers), ranges
    left = _client(r2.endpoint).list_multipart_uploads(Bucket=r2_store.bucket).get("Uploads", [])
    assert left == []


def test_a_publisher_losing_the_pointer_race_never_moves_it_back(r2_store):
    """Two publishers of one run move the pointer at once, one to v5 and one to v6: whatever the order, the
    pointer ends at v6, and the v5 writer is refused (PointerError) rather than moving it backwards."""
    key = signing.generate_private_key()
    pub = signing.public_key_b64(key)
    run = "r2-ptr"
    advance_pointer(r2_store, make_pointer(run, 4, 1, "sha256:" + "4" * 64, key), pub)
    for _ in range(3):
        barrier = threading.Barrier(2)

        def move(v: int, barrier=barrier) -> str:
            barrier.wait()
            try:
                advance_pointer(r2_store, make_pointer(run, v, 1, "sha256:" + f"{v % 10}" * 64, key), pub)
                return "moved"
            except PointerError:
                return "refused"

        current = read_pointer(r2_store, run, pub)[0].version
        with ThreadPoolExecutor(2) as pool:
            low, high = pool.map(move, (current + 1, current + 2))
        assert high == "moved" and low in ("moved", "refused"), (low, high)
        assert read_pointer(r2_store, run, pub)[0].version == current + 2


def test_a_second_writer_of_an_anchor_is_told_version_taken(r2_store):
    """Two writers publish anchor v3 of one run at once (a restarted learner beside its old self): one
    anchor lands whole and verifies; the other is told VersionTaken and leaves no manifest of its own."""
    key = signing.generate_private_key()
    pub = signing.public_key_b64(key)
    rng = np.random.default_rng(0)
    states = [{f"w{j}": rng.standard_normal((128, 128)).astype(np.float32) for j in range(4)} for _ in range(2)]
    barrier = threading.Barrier(2)

    def write(i: int):
        barrier.wait()
        try:
            return write_anchor(r2_store, "r2-anchor", 3, "bf16", states[i], key, shard_bytes=64 << 10)
        except VersionTaken:
            return None

    with ThreadPoolExecutor(2) as pool:
        made = list(pool.map(write, range(2)))
    assert sum(m is not None for m in made) == 1, made
    winner = next(m for m in made if m is not None)
    manifest, state = read_anchor(r2_store, "r2-anchor", 3, pub)
    assert manifest.state_digest == winner.state_digest
    keys = r2_store.list_keys(layout.anchor_prefix("r2-anchor", 3))
    assert keys == [layout.anchor_manifest_key("r2-anchor", 3),
                    *(layout.anchor_shard_key("r2-anchor", 3, i) for i in range(4))], keys
    assert sorted(state) == ["w0", "w1", "w2", "w3"]
