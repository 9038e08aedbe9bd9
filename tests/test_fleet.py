"""A short fleet run (bench/fleet): 32 simulated workers of every kind against moto behind the fault proxy
(R2-like latency, faults, a rate cap), the real rollout source and publisher, a small cold-join storm.
Every uploaded record must be accounted for exactly once, the bucket must verify, no version may name two
states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_short_fleet_run_accounts_for_every_record(tmp_path):
    out = tmp_path / "fleet.json"
    res = subprocess.run([sys.executable, "-m", "bench.fleet", "--scale", "32", "--duration", "40", "--group-s", "8",
                          "--step-s", "1", "--worker-procs", "2", "--storm", "8", "--storm-at", "20", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=880)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    acc = run["accounting"]
    assert acc["exactly_once"] and acc["problems"] == [], acc["problems"]
    assert run["bucket_verifies"] and run["versions"]["problems"] == [] and run["ok"]
    fates = acc["fates"]
    assert acc["records"] == sum(fates.values()) and fates.get("used", 0) >= 16, fates
    assert fates.get("unread_in_window", 0) == 0, fates
    # the hostile workers' records were read and dropped for what they were built to trip
    hostile = acc["by_kind"]["hostile"]
    assert any(k.startswith("dropped:hostile:") for k in hostile), hostile
    assert run["throughput"]["steps"] >= 2 and run["workers"]["joins"] >= 32
    assert run["storm"]["joined"] == 8, run["storm"]
    assert run["cost"]["class_a_per_hour"] > 0 and run["cost"]["class_b_per_hour"] > 0
    assert run["wire"]["requests"] > 200


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_ingest_ceiling_bench_drains_a_backlog_with_both_readers(tmp_path):
    """bench/fleet/ingest.py's smoke: a backlog from 64 workers, more arriving live, drained through the proxy
    by the chunked reads (before) and the sliding window (today's); every record handled, phases timed."""
    out = tmp_path / "ingest.json"
    res = subprocess.run([sys.executable, "-m", "bench.fleet.ingest", "--workers", "64", "--backlog", "120",
                          "--live-rps", "10", "--trials", "1", "--limit", "120", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["command"].startswith("python -m bench.fleet.ingest") and doc["machine"]["cpu"]
    assert [d["options"]["reader"] for d in doc["drains"]] == ["chunked", "window"]
    for d in doc["drains"]:
        assert d["complete"] and d["handled"] >= 120 and d["accepted"] >= 120 and d["groups_per_s"] > 0, d
        assert d["learner_requests"]["learner GET rollout"] >= 120
        assert sum(d["phase_s"].values()) <= d["wall_s"] * 1.05, d
