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

from bench.fleet.accounting import account, ledger_problems
from bench.fleet.workers import HOSTILE

REPO = Path(__file__).resolve().parents[1]


def _small_fleet():
    """Three uploads (one hostile), what the learner did with them: one used, one pooled, one dropped."""
    run = "acct"
    keys = [f"{run}/rollouts/v0000000003/w{i}/g{i}.rec" for i in range(3)]
    workers = [{"kind": "honest", "uploads": [{"key": keys[0], "sure": True, "expect": None, "t_done": 1.0}]},
               {"kind": "honest", "uploads": [{"key": keys[1], "sure": True, "expect": None, "t_done": 1.0}]},
               {"kind": "hostile", "uploads": [{"key": keys[2], "sure": True, "expect": "vocab", "t_done": 1.0}]}]
    learner = {"uses": [(keys[0], 1, 0.1, 0)], "journal": [(keys[2], "vocab")], "drops": {"vocab": 1},
               "window": [3], "read": list(keys), "metrics": {"rollout/pool": 2}}
    return keys, workers, learner


def test_the_accounting_breaks_on_a_lost_or_double_counted_group():
    """The ledger's counts come from their own witnesses (workers, the learner's counters), so a group lost
    or counted twice on the way makes the accounting fail (the sum of the fates once stood in for this, true
    by construction)."""
    keys, workers, learner = _small_fleet()
    acc = account(keys, workers, learner, reuse_cap=2, learner_lists={})
    assert acc["exactly_once"] and ledger_problems(acc) == [] and acc["hostile_caught"] == {"vocab": 1}, acc
    lost = account(keys[:2], workers, learner, reuse_cap=2, learner_lists={})  # a landed upload gone
    assert any("uploads the workers saw land" in p for p in lost["problems"]) and not lost["exactly_once"]
    twice = account(keys, workers, {**learner, "drops": {"vocab": 2}}, reuse_cap=2, learner_lists={})
    assert any("the source's drop counters 2" in p for p in ledger_problems(twice)), twice["problems"]
    unpooled = account(keys, workers, {**learner, "metrics": {"rollout/pool": 1}}, reuse_cap=2, learner_lists={})
    assert any("pooled 1 != the source's pool" in p for p in ledger_problems(unpooled)), unpooled["problems"]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_short_fleet_run_accounts_for_every_record(tmp_path):
    out = tmp_path / "fleet.json"
    res = subprocess.run([sys.executable, "-m", "bench.fleet", "--scale", "32", "--duration", "40", "--group-s", "8",
                          "--step-s", "1", "--worker-procs", "2", "--storm", "8", "--storm-at", "20", "--staleness", "12",
                          "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=880)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    acc = run["accounting"]
    assert acc["exactly_once"] and acc["problems"] == [], acc["problems"]
    assert run["bucket_verifies"] and run["versions"]["problems"] == [] and run["ok"]
    fates = acc["fates"]
    assert ledger_problems(acc) == [] and fates.get("used", 0) >= 16, (fates, acc["ledger"])
    assert fates.get("unread_in_window", 0) == 0, fates
    # every hostile kind was injected and dropped for exactly what it was built to trip (a staleness of 12
    # versions: on a loaded machine the learner falls seconds behind, and a record aged out is never judged)
    assert set(acc["hostile_caught"]) == set(HOSTILE), acc["hostile_caught"]
    hostile = acc["by_kind"]["hostile"]
    assert sum(n for k, n in hostile.items() if k.startswith("dropped:hostile:")) >= len(HOSTILE), hostile
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


def test_the_real_sizes_constants_are_the_measured_ones():
    """--sizes real declares what bench/results/pulse_gpu.json measured: the 1.5B bf16 state and its patch."""
    from bench.fleet.spec import REAL_ANCHOR_BYTES, REAL_PATCH_BYTES, FleetSpec

    measured = json.loads((REPO / "bench/results/pulse_gpu.json").read_text())
    assert (measured["plane"], measured["state_bytes"], measured["patch_bytes"]) == (
        "bf16", REAL_ANCHOR_BYTES, REAL_PATCH_BYTES)
    assert FleetSpec(anchor_bytes=REAL_ANCHOR_BYTES).anchor_shards == 2  # 2 GiB shards (worker_contract/anchor.py)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_fleet_with_a_real_fleets_sizes_counts_the_declared_bytes(tmp_path):
    """bench.fleet's sized mode, small: 8 workers, a 3 GB anchor (2 shards) and 42 MB patches at 10 Gbit/s a
    connection (a join's anchor takes 2.4 s). The wire counts each shard and patch read at its declared size
    and the real bytes of no sized object on top; no join beats the bandwidth; the learner's anchor uploads
    count their multipart requests; the egress and lag figures come from those counts."""
    out = tmp_path / "sized.json"
    anchor, patch, bw = 3_000_000_000, 42_000_000, 10_000e6 / 8
    res = subprocess.run([sys.executable, "-m", "bench.fleet", "--scale", "8", "--duration", "25", "--group-s", "5",
                          "--step-s", "1", "--worker-procs", "2", "--anchor-bytes", "3e9", "--patch-bytes", "42e6",
                          "--bandwidth-mbit", "10000", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["ok"] and run["sized_problems"] == [] and run["accounting"]["exactly_once"]
    wire, sync = run["wire"], run["sync"]
    shards, patches = wire["sized_requests"]["worker GET anchor"], wire["sized_requests"].get("worker GET patch", 0)
    assert shards >= 16 and shards % 2 == 0  # every worker joined: two shards each
    assert wire["declared"]["worker GET anchor"] == shards * anchor // 2
    assert wire["declared"].get("worker GET patch", 0) == patches * patch
    # the anchor's bytes on the wire are the declared shards plus the manifests' own few KB, nothing more
    assert 0 < wire["bytes_down"]["worker anchor"] - wire["declared"]["worker GET anchor"] < shards * 20_000
    assert wire["bytes_down"].get("worker patch", 0) - patches * patch < 100_000
    assert sync["joins"]["first_joined"] == 8 and sync["joins"]["first_join_s"]["min"] >= anchor / bw
    assert sync["egress"]["worker_gb"] == round(sum(v for k, v in wire["bytes_down"].items()
                                                    if k.startswith("worker ")) / 1e9, 3)
    puts = wire["sized_requests"]["learner PUT anchor"]
    assert puts >= 2 and wire["modeled"]["learner MPU_PART anchor"] == puts * -(-anchor // 2 // (16 << 20))
    assert [r["pointer"] for r in sync["lag_timeline"]] == sorted(r["pointer"] for r in sync["lag_timeline"])
    assert run["cost"]["stored_bytes"] >= anchor
