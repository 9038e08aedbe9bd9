"""The fault proxy (bench/faultproxy.py) injects what it claims: its latency distribution (median and 99th
percentile, as a client sees it), its random fault rate and kinds, and its request-rate cap."""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

from bench.faultproxy import FaultProxy, Latency


def _hammer(url: str, n: int, threads: int = 8) -> list[tuple[float, int | None]]:
    """`n` HEAD requests on a missing key over `threads` keep-alive connections: (seconds, status or None)."""
    host = urlsplit(url)
    out: list[tuple[float, int | None]] = []
    lock = threading.Lock()

    def run(count: int) -> None:
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
        for _ in range(count):
            t0 = time.monotonic()
            try:
                conn.request("HEAD", "/stoa-test/missing-key")
                r = conn.getresponse()
                r.read()
                status = r.status
            except (ConnectionError, http.client.HTTPException, OSError):
                conn.close()
                conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
                status = None
            with lock:
                out.append((time.monotonic() - t0, status))
        conn.close()

    ts = [threading.Thread(target=run, args=(n // threads,)) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_latency_distribution(moto_server):
    lat = Latency(median_s=0.04, p99_s=0.2)
    with FaultProxy(moto_server.endpoint, latency=lat, seed=7) as proxy:
        seen = _hammer(proxy.url, 480)
        drawn = [r.delay_s for r in proxy.requests()]
    assert len(drawn) == 480 and all(s == 404 for _, s in seen)
    # the draws follow the claimed log-normal (a sampling spread of about 10% at this count)
    assert 0.034 < statistics.median(drawn) < 0.047, statistics.median(drawn)
    assert 0.14 < _quantile(drawn, 0.99) < 0.29, _quantile(drawn, 0.99)
    assert min(drawn) > 0.005  # a log-normal: no zero delays
    # and a client sees them: never faster than the draw, and the server adds only its own time on top
    client = [t for t, _ in seen]
    assert statistics.median(client) >= 0.034, statistics.median(client)
    assert statistics.median(client) < statistics.median(drawn) + 0.15  # moto answers a HEAD in ms (more when loaded)


def test_fault_rate_and_kinds(moto_server):
    with FaultProxy(moto_server.endpoint, rate=0.25, kinds=("503", "429", "reset"), seed=3) as proxy:
        seen = _hammer(proxy.url, 800)
        faults = Counter(r.fault for r in proxy.requests())
    statuses = Counter(s for _, s in seen)
    n = sum(faults.values())
    assert n == 800
    # 25% +- 4 standard deviations (1.5 points at 800 draws)
    assert 0.19 < (n - faults[None]) / n < 0.31, faults
    assert all(faults[k] > 30 for k in ("503", "429", "reset")), faults
    # what the client got is what was injected: error answers, dropped connections, the rest forwarded
    assert statuses[503] == faults["503"] and statuses[429] == faults["429"], (statuses, faults)
    assert statuses[None] == faults["reset"] and statuses[404] == faults[None], (statuses, faults)


def test_rate_cap(moto_server):
    with FaultProxy(moto_server.endpoint, cap_rps=40, cap_burst=10) as proxy:
        t0 = time.monotonic()
        seen = _hammer(proxy.url, 400, threads=8)
        elapsed = time.monotonic() - t0
        capped = sum(r.fault == "cap" for r in proxy.requests())
    admitted = sum(s == 404 for _, s in seen)
    assert capped == sum(s == 429 for _, s in seen) and admitted + capped == 400
    # the token bucket admits at most burst + rate x time, and (with clients faster than that) about that
    assert admitted <= 10 + 40 * elapsed + 1, (admitted, elapsed)
    assert admitted >= 0.6 * 40 * elapsed, (admitted, elapsed)


def test_a_sized_object_takes_its_declared_time_and_only_its_real_bytes_move(moto_server):
    """The sizer's model (bench/fleet's real sizes): an object declared 3 MB at 1 MB/s answers its GET in
    about 3 s, paced so that a client's 2 s read timeout never fires, with its own 2000 bytes; a PUT declared
    4 MB over 2 connections answers 2 s later (no bytes flow back meanwhile: the client's read timeout must be
    longer); an unsized key or a missing sized one answers at the latency."""
    import boto3
    from botocore.config import Config

    body = bytes(range(250)) * 8

    def sizer(req):
        if req.path.endswith("/big"):
            return (3_000_000, 1) if req.method == "GET" else (4_000_000, 2)
        return None

    lat = Latency(median_s=0.01, p99_s=0.02, bandwidth_bps=1e6)
    with FaultProxy(moto_server.endpoint, latency=lat, sizer=sizer) as proxy:
        def client(read_timeout: float):
            return boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1", aws_access_key_id="x",
                                aws_secret_access_key="x", config=Config(read_timeout=read_timeout,
                                                                         retries={"total_max_attempts": 1}))

        def timed(fn, **kw):
            t0 = time.monotonic()
            out = fn(Bucket="stoa-test", **kw)
            return time.monotonic() - t0, out

        put_s, _ = timed(client(5.0).put_object, Key="big", Body=body)
        c = client(2.0)
        c.put_object(Bucket="stoa-test", Key="small", Body=b"s" * 10)
        t0 = time.monotonic()
        got = c.get_object(Bucket="stoa-test", Key="big")["Body"].read()  # headers at once, the bytes paced
        get_s = time.monotonic() - t0
        small_s, _ = timed(c.get_object, Key="small")
        t0 = time.monotonic()
        try:
            c.get_object(Bucket="stoa-test", Key="missing/big")
        except c.exceptions.NoSuchKey:
            missing_s = time.monotonic() - t0
        reqs = proxy.requests()
    put, _, get, small, missing = reqs
    assert [r.status for r in reqs] == [200, 200, 200, 200, 404]
    assert got == body and get.resp_bytes == len(body) and put.length == len(body)
    assert (put.declared_bytes, put.streams, get.declared_bytes, get.streams) == (4_000_000, 2, 3_000_000, 1)
    assert 2.0 <= put_s < 3.0 and 3.0 <= get_s < 4.0, (put_s, get_s)
    assert abs((get.transfer[1] - get.transfer[0]) - 3.0) < 1e-6 and abs(get.delay_s - get.transfer[1] + get.t) < 1e-6
    assert small.declared_bytes == missing.declared_bytes == 0 and small.transfer is None is missing.transfer
    assert small_s < 1.0 and missing_s < 1.0, (small_s, missing_s)
