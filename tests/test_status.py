"""`status`: what it reads from a run's bucket, that its listing stays bounded, and its three outputs."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opsbucket import build_run
from sshd import sshd_server  # noqa: F401  (real sshd on 127.0.0.1)

from infra.ops.cost import UsageAssumptions, bucket_usage, estimate_cost
from infra.ops.status import collect_status
from infra.ops.status_view import render_status, show_status
from worker_contract import layout
from worker_contract.store.file import FileStore

REPO = Path(__file__).resolve().parent.parent
RUN = "ops-status-a"


class ListCounter(FileStore):
    """A real file store that records the prefixes it is asked to list (to prove the listing is bounded)."""

    def __init__(self, root):
        super().__init__(root)
        self.prefixes: list[tuple[str, str | None]] = []

    def list(self, prefix="", start_after=None):
        self.prefixes.append((prefix, start_after))
        return super().list(prefix, start_after)


WORKERS = {
    "mac-a": [9, 9, 10, 10, 10],   # up to date
    "mac-b": [8, 8, 9],            # one behind
    "old-box": [2, 2],             # long gone: outside the listed window
}
GONE = {"old-box": 3600.0}         # its groups are an hour old


@pytest.fixture
def built(store):
    return build_run(store, RUN, pointer=10, anchor_interval=4, workers=WORKERS, gone_s=GONE)


def test_status_reads_pointer_anchors_workers_and_stats(store, built):
    st = collect_status(store, RUN, now=time.time() + 5, window_min=5)  # the pointer is stamped when written
    assert st.pointer_version == 10 and 0 <= st.pointer_age_s < 60 and st.pointer_anchor == 9
    assert st.anchors == built.anchors == [1, 5, 9]
    assert not st.notes
    assert st.manifest["n_samples"] == 8 and st.manifest["staleness"] == 3
    rows = {w.worker_id: w for w in st.workers}
    assert set(rows) == {"mac-a", "mac-b"}  # old-box only wrote v2: outside the window (10 - 3 - 4 = 3)
    assert rows["mac-a"].newest_version == 10 and rows["mac-a"].lag == 0 and rows["mac-a"].groups == 5
    assert rows["mac-b"].versions == [8, 9] and rows["mac-b"].lag == 1 and rows["mac-b"].groups == 3
    assert st.staleness == {0: 3, 1: 3, 2: 2}
    assert st.staleness_consumed == {0: 5 * 9, 1: 3 * 9}  # the learner's histogram over v2..v10
    assert (rows["mac-a"].used, rows["mac-a"].dropped) == (4, 1)  # the learner's own per-worker counts
    assert st.drops == built.drops_total == {"stale": 9, "wrong_group_size": 2}
    assert st.drops_recent == st.drops  # every version is within the stats window read
    assert [p.version for p in st.publishes][:3] == [10, 9, 8]
    assert st.publishes[0].patch_bytes == built.patch_bytes[10]
    assert st.publishes[0].latency_s == pytest.approx(built.latency_s[10]) and st.publishes[0].groups == 8


def test_worker_times_and_rate_from_record_created_at(store, built):
    # The store's listing carries no modification time, so status reads the newest records' created_at.
    now = built.now
    st = collect_status(store, RUN, now=now, window_min=1)
    rows = {w.worker_id: w for w in st.workers}
    assert rows["mac-a"].last_seen_s == pytest.approx(10)
    assert rows["mac-b"].last_seen_s == pytest.approx(10)
    assert rows["mac-a"].groups_recent == 5 and rows["mac-b"].groups_recent == 3  # all within 60 s
    assert st.groups_per_minute == pytest.approx(8.0)
    assert st.active_workers == 2
    later = collect_status(store, RUN, now=now + 3600, window_min=5)
    assert later.active_workers == 0 and later.groups_per_minute == 0


def test_bytes_by_prefix_matches_the_bucket(store, built):
    st = collect_status(store, RUN, now=built.now)
    u = st.bytes_by_prefix.prefixes
    everything = list(store.list(layout.run_prefix(RUN)))
    assert sum(p.objects for p in u.values()) == len(everything)
    assert sum(p.bytes for p in u.values()) == sum(o.size for o in everything)
    anchor_objects = list(store.list(layout.anchors_prefix(RUN)))
    assert u["rollouts"].objects == 10 and u["versions"].objects == 9
    assert u["anchors"].objects == len(anchor_objects) >= 6 and u["anchors"].bytes == sum(o.size for o in anchor_objects)
    assert u["versions"].bytes == sum(built.patch_bytes.values())
    assert u["stats"].objects == 9 and u["run.json"].objects == 1 and u["current.json"].objects == 1


def test_listing_is_bounded_by_recent_versions(file_store):
    b = build_run(file_store, RUN, pointer=40, anchor_interval=20,
                  workers={"w1": list(range(1, 41)), "w2": [39, 40]})
    counted = ListCounter(file_store.root)
    st = collect_status(counted, RUN, now=b.now, include_bytes=False)
    rollout_lists = [p for p, _ in counted.prefixes if p.startswith(layout.rollouts_prefix(RUN))]
    # the window's versions, and the one just below them (is the window longer than they reach back?)
    assert sorted(rollout_lists) == [layout.rollout_version_prefix(RUN, v) for v in range(32, 42)]
    stats_lists = [s for p, s in counted.prefixes if p == layout.stats_prefix(RUN)]
    assert stats_lists == [layout.stats_key(RUN, 28)]
    assert layout.run_prefix(RUN) not in [p for p, _ in counted.prefixes]  # no full listing without bytes
    assert {w.worker_id: w.groups for w in st.workers} == {"w1": 8, "w2": 2}
    counted.prefixes.clear()
    collect_status(counted, RUN, now=b.now, include_bytes=True)
    assert [p for p, _ in counted.prefixes].count(layout.run_prefix(RUN)) == 1  # the one full listing


def test_unpublished_run_is_reported_not_crashed(store):
    st = collect_status(store, "never-made")
    assert st.pointer_version is None and st.manifest is None and st.workers == []
    assert any("run.json is absent" in n for n in st.notes)
    render_status(st)  # renders with nothing in it


def test_cost_estimate_counts_writes_and_scales_with_time(store, built):
    usage = bucket_usage(store, RUN)
    a = UsageAssumptions(learner_busy_fraction=0.0, worker_poll_interval_s=10.0)
    c1 = estimate_cost(usage, elapsed_s=3600, versions=10, workers=2, staleness=3, assumptions=a)
    writes = sum(p.objects for p in usage.prefixes.values())  # all small: one PUT each
    assert c1.class_a_ops == writes + (10 - 1) + 1  # + earlier pointer versions + one listing page
    assert c1.class_b_ops == 10 + 2 * 3600 / 10 + 2 * (9 + 1 + 1)  # records, pointer polls, patches + anchor
    assert c1.usd_class_b == pytest.approx(c1.class_b_ops / 1e6 * 0.36)
    c2 = estimate_cost(usage, elapsed_s=7200, versions=10, workers=2, staleness=3, assumptions=a)
    assert c2.class_b_ops > c1.class_b_ops and c2.gb_month_so_far == pytest.approx(2 * c1.gb_month_so_far)
    big = UsageAssumptions(multipart_threshold_bytes=1000, multipart_part_bytes=1000)
    c3 = estimate_cost(bucket_usage(store, RUN, big), elapsed_s=3600, versions=10, workers=2, staleness=3,
                       assumptions=big)
    assert c3.class_a_ops > c1.class_a_ops  # anchor shards over 1000 bytes now go in parts + create + complete


def test_status_shown_in_a_file_bucket_and_moto_gives_the_same_view(file_store, s3_store):
    now = time.time() + 5
    for s in (file_store, s3_store):
        build_run(s, RUN, pointer=10, anchor_interval=4, workers=WORKERS, now=now, gone_s=GONE)
    volatile = {"store", "bytes_by_prefix", "cost", "pointer_age_s", "publishes"}
    a = collect_status(file_store, RUN, now=now).model_dump(exclude=volatile)
    b = collect_status(s3_store, RUN, now=now).model_dump(exclude=volatile)
    for view in (a, b):
        view["manifest"].pop("created_at")
    assert a == b and a["pointer_version"] == 10 and len(a["workers"]) == 2


def test_json_output_and_watch_refreshes(store, built, capsys, monkeypatch):
    import infra.ops.status_view as view

    monkeypatch.setattr(view, "WATCH_INTERVAL_S", 0.05)
    show_status(store, RUN, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["pointer_version"] == 10 and data["anchors"] == [1, 5, 9]
    show_status(store, RUN, as_json=True, watch=True, iterations=3)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["run"] == RUN for line in lines)


def test_rich_table_shows_the_numbers(store, built):
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(render_status(collect_status(store, RUN, now=built.now)))
    text = console.export_text()
    for needle in ("v10", "anchor v9", "mac-a", "mac-b", "wrong_group_size", "bucket bytes by prefix",
                   "rollouts", "class A ops", "staleness", "recent publishes", "trained on", "dropped"):
        assert needle in text, needle


def test_invoke_status_task_against_moto(moto_server, s3_store, tmp_path):
    build_run(s3_store, RUN, pointer=10, anchor_interval=4, workers=WORKERS, gone_s=GONE)
    env = {**moto_server.env(), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "invoke", "status", "--run", RUN, "--json",
                          "--store", s3_store.url], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["pointer_version"] == 10 and data["store"] == s3_store.url
    assert data["cost"]["class_a_ops"] > 0
    assert moto_server.env()["AWS_SECRET_ACCESS_KEY"] not in out.stdout + out.stderr


def test_invoke_status_refuses_missing_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "invoke", "status", "--store", f"file://{tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--run is required" in out.stderr


def test_forged_pointer_is_flagged(store, built):
    from worker_contract import signing
    from worker_contract.pointer import make_pointer

    forged = make_pointer(RUN, 99, 9, "sha256:" + "0" * 64, signing.generate_private_key())
    store.put(layout.pointer_key(RUN), forged.to_bytes())
    st = collect_status(store, RUN, include_bytes=False)
    assert st.pointer_version == 99 and any("does not verify" in n for n in st.notes)


def test_host_adds_the_trainer_box_view_over_real_ssh(store, built, sshd_server, tmp_path, capsys):  # noqa: F811
    # The box is this machine through a real sshd; nothing is deployed in its remote dir, and the box says so.
    st = show_status(store, RUN, as_json=True, host=sshd_server.host, ssh_key=str(sshd_server.client_key),
                     remote_dir=str(tmp_path / "not-deployed"))
    data = json.loads(capsys.readouterr().out)
    assert data["remote"] == st.remote and st.remote["deployed"] is False and st.remote["alive"] is False
    assert st.pointer_version == 10  # the bucket view is complete either way


def test_host_unreachable_is_a_note_not_a_crash(store, built, tmp_path):
    from infra.ops.status_view import attach_remote

    st = collect_status(store, RUN, include_bytes=False)
    attach_remote(st, "nobody@127.0.0.1:1", ssh_key=str(tmp_path / "no-key"))
    assert st.remote is None and any(n.startswith("trainer box nobody@127.0.0.1:1") for n in st.notes)


class GetCounter(FileStore):
    """A real file store that counts reads of rollout records."""

    reads = 0

    def get(self, key):
        if key.startswith(layout.rollouts_prefix(RUN)):
            GetCounter.reads += 1
        return super().get(key)


def test_record_reads_are_bounded_and_cached_between_refreshes(file_store, monkeypatch):
    import infra.ops.status as status_mod

    b = build_run(file_store, RUN, pointer=10, anchor_interval=4, workers=WORKERS, gone_s=GONE)
    monkeypatch.setattr(status_mod, "MAX_RECORD_READS", 3)
    counted, cache = GetCounter(file_store.root), {}
    GetCounter.reads = 0
    st = collect_status(counted, RUN, now=b.now, include_bytes=False, record_times=cache)
    # 3 records, and old-box's newest below the listed versions (an hour old: the listing covers the window)
    assert GetCounter.reads == 4 and len(cache) == 4 and any("from 3 records only" in n for n in st.notes)
    # each listed worker's newest first, in turn: mac-a's v10 and mac-b's v9, then mac-a's next
    assert {w.worker_id for w in st.workers if w.last_seen_s is not None} == {"mac-a", "mac-b"}
    for _ in range(2):
        st = collect_status(counted, RUN, now=b.now, include_bytes=False, record_times=cache)
    assert GetCounter.reads == 9 and len(cache) == 9 and not st.notes  # every record read exactly once
    collect_status(counted, RUN, now=b.now, include_bytes=False, record_times=cache)
    assert GetCounter.reads == 9


@pytest.mark.parametrize("as_json", [False, True], ids=["tables", "json"])
def test_piped_watch_ends_quietly_when_the_reader_goes_away(file_store, tmp_path, as_json):
    # `invoke status --watch | head -3`: once head has its lines and exits, the next refresh finds the pipe
    # closed and the watch ends, quietly (no traceback), with the closed-pipe status 141.
    build_run(file_store, RUN, pointer=4, anchor_interval=4, workers={"mac-a": [3, 4]})
    cmd = [sys.executable, "-m", "invoke", "status", "--run", RUN, "--store", f"file://{file_store.root}",
           "--watch"] + (["--json"] if as_json else [])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    try:
        # the first view is printed at once, off a terminal too (it waited for Ctrl-C, printing nothing)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        first = os.read(proc.stdout.fileno(), 4096).decode(errors="replace") if ready else ""
        proc.stdout.close()  # the reader goes away, as head does
        rc = proc.wait(timeout=60) if ready else None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode()
    assert RUN in first, "the watch printed nothing to the pipe within 60 s"
    assert rc == 141, (rc, err)
    assert "Traceback" not in err and "Error" not in err, err


def test_a_partial_read_estimates_the_rate_and_leaves_unread_workers_unknown():
    """With 3 workers uploading about 365 groups a minute, status read the newest 64 records and showed 12.8
    groups/min (64 in a 5-minute window) and a worker none of whose records it read as idle (0 recent)."""
    from infra.ops.status import summarize_workers
    from worker_contract.store.base import ObjectInfo

    now, items, times = 10_000.0, [], {}
    for i in range(300):  # mac-a and mac-b upload a group every 0.2 s between them; mac-c's are older versions
        worker = ("mac-a", "mac-b", "mac-c")[i % 3]
        key = layout.rollout_key(RUN, 100 - i // 30, worker, f"g{i}")
        items.append((layout.parse_rollout_key(key), ObjectInfo(key, 1, "e")))
        if worker != "mac-c" and len(times) < 64:  # the newest records read, none of mac-c's
            times[key] = now - 0.2 * len(times)
    rows, rate = summarize_workers(items, times, 100, now, 300.0, partial=True)
    assert rate == pytest.approx(300, rel=0.01)  # each worker one upload every 0.4 s: 300 a minute, not 64 / 5
    by = {r.worker_id: r for r in rows}
    assert by["mac-c"].groups_recent is None and by["mac-a"].groups_recent == 32


def test_a_partial_read_sees_every_worker_and_sums_their_rates(file_store):
    """3 workers each upload a group every 0.5 s (about 360 a minute in all), all at the pointer's version, with
    the reference worker's time-ordered group ids. Status read 64 records picked by (version, key): all of the
    alphabetically last worker's, none of the others', and showed that one worker's rate as the fleet's
    (120 a minute) with the other two unknown. Read through the bounded reader, every worker is seen and the
    rate is the sum of theirs."""
    from opsbucket import record

    import infra.ops.status as status_mod

    now = 10_000.0
    for i in range(120):
        for worker in ("mac-a", "mac-b", "mac-c"):
            t = now - 0.5 * i
            gid = f"g{int(t * 1000):013d}-{i:08x}"
            file_store.put_if_absent(layout.rollout_key(RUN, 100, worker, gid),
                                     record(RUN, worker, gid, 100, created_at=t))
    items = status_mod.recent_rollouts(file_store, RUN, 96, 101)
    times, partial = status_mod._upload_times(file_store, items, {})
    assert partial and len(times) == status_mod.MAX_RECORD_READS
    rows, rate = status_mod.summarize_workers(items, times, 100, now, 300.0, partial=True)
    assert rate == pytest.approx(360, rel=0.02)
    # a worker whose one group arrived just now adds its count over the window, not 1 / 0.5 s
    gid = f"g{int((now - 0.5) * 1000):013d}-00000000"
    file_store.put_if_absent(layout.rollout_key(RUN, 100, "mac-d", gid), record(RUN, "mac-d", gid, 100, now - 0.5))
    items = status_mod.recent_rollouts(file_store, RUN, 96, 101)
    times, partial = status_mod._upload_times(file_store, items, {})
    rows, rate = status_mod.summarize_workers(items, times, 100, now, 300.0, partial=True)
    assert rate == pytest.approx(360, rel=0.02)
    by = {r.worker_id: r for r in rows}
    assert all(by[w].last_seen_s == pytest.approx(0) and by[w].groups_recent >= 21 for w in ("mac-a", "mac-b", "mac-c"))


def test_versions_that_come_fast_reach_back_less_than_the_window(file_store):
    """The embedded run publishes about a version a second: the listed versions (pointer back to staleness + 4)
    reach back some seconds, and status divided what they hold by the whole 5-minute window (11 a minute where
    about 460 were uploaded in the last minute). The rate is over the seconds they reach back, and a note says so."""
    from opsbucket import record

    from infra.ops import status as status_mod

    now = 10_000.0
    for v in range(90, 101):  # 11 versions a second apart, 2 workers, 4 groups each a version
        for worker in ("mac-a", "mac-b"):
            for j in range(4):
                t = now - (100 - v) - j * 0.2
                gid = f"g{int(t * 1000):013d}-{j:08x}"
                file_store.put_if_absent(layout.rollout_key(RUN, v, worker, gid), record(RUN, worker, gid, v, t))
    items = status_mod.recent_rollouts(file_store, RUN, 100 - 3 - status_mod.EXTRA_VERSIONS_BACK, 101)
    times, partial = status_mod._upload_times(file_store, items, {})
    assert not partial and len(times) == 8 * 8  # versions 93..100
    assert status_mod._uploads_below(file_store, RUN, 93, now - 300, {})  # v92's uploads are seconds old
    reach = status_mod._listing_reach(file_store, RUN, 93, times, partial, now, 300.0, {})
    assert 7 < reach < 8  # v93's first group, 7.6 s ago
    _, rate = status_mod.summarize_workers(items, times, 100, now, 300.0, partial, reach)
    assert rate == pytest.approx(480, rel=0.1)  # 8 groups a second
    notes: list[str] = []
    activity = status_mod._activity(file_store, RUN, 100, 3, now, 300.0, {}, notes)
    assert activity["groups_per_minute"] == pytest.approx(480, rel=0.1) and any("reach back" in n for n in notes)
