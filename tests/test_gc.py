"""`gc`: deletes only what no joiner can need; a joiner still finds an anchor and every patch after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from opsbucket import build_run

from infra.ops.gc import GcError, apply_gc, plan_gc
from infra.ops.status import list_anchors, read_pointer
from worker_contract import layout

REPO = Path(__file__).resolve().parent.parent
RUN = "ops-gc-a"
# anchors at 1, 4, 8 and a half-written one at 12 (above the pointer); every version 1..11 has rollouts
WORKERS = {"w1": list(range(1, 12)), "w2": [3, 6, 9, 10, 11]}


@pytest.fixture
def built(store):
    b = build_run(store, RUN, pointer=11, anchors=[1, 4, 8], workers=WORKERS)
    store.put(layout.anchor_shard_key(RUN, 12, 0), b"partial")  # no manifest yet: the publisher is mid-way
    return b


def joinable(store, run: str) -> tuple[int, list[int]]:
    """What a cold joiner does first: the newest anchor at or below the pointer, then every patch up to it."""
    pointer, _ = read_pointer(store, run)
    anchor = max(v for v in list_anchors(store, run) if v <= pointer)
    for shard in (0, 1):
        assert store.exists(layout.anchor_shard_key(run, anchor, shard))
    patches = list(range(anchor + 1, pointer + 1))
    missing = [v for v in patches if not store.exists(layout.patch_key(run, v))]
    assert not missing, f"a joiner from anchor v{anchor} misses patches {missing}"
    return anchor, patches


def keys(store, prefix):
    return [o.key for o in store.list(prefix)]


def test_keep_one_anchor(store, built):
    plan = plan_gc(store, RUN, keep_anchors=1)
    assert plan.kept_anchors == [8]  # v12 has no manifest yet, and is above the pointer: untouched
    apply_gc(store, plan)
    assert list_anchors(store, RUN) == [8]
    assert keys(store, layout.anchor_prefix(RUN, 1)) == keys(store, layout.anchor_prefix(RUN, 4)) == []
    assert keys(store, layout.anchor_prefix(RUN, 12)) == [layout.anchor_shard_key(RUN, 12, 0)]
    assert [layout.patch_version_of(k) for k in keys(store, layout.versions_prefix(RUN))] == [8, 9, 10, 11]
    left = {layout.parse_rollout_key(k).version for k in keys(store, layout.rollouts_prefix(RUN))}
    assert left == {8, 9, 10, 11}  # 11 - 3 = 8 is the oldest version the learner still accepts
    assert joinable(store, RUN) == (8, [9, 10, 11])


def test_keep_two_anchors_keeps_the_older_path_too(store, built):
    apply_gc(store, plan_gc(store, RUN, keep_anchors=2))
    assert list_anchors(store, RUN) == [4, 8]
    assert [layout.patch_version_of(k) for k in keys(store, layout.versions_prefix(RUN))] == list(range(4, 12))
    assert joinable(store, RUN) == (8, [9, 10, 11])


def test_never_touches_manifest_pointer_stats_or_pointer_version(store, built):
    before = {o.key: o.etag for o in store.list(layout.run_prefix(RUN))}
    plan = plan_gc(store, RUN, keep_anchors=1)
    apply_gc(store, plan)
    after = {o.key: o.etag for o in store.list(layout.run_prefix(RUN))}
    gone = set(before) - set(after)
    assert gone == set(plan.keys) and gone
    for key in (layout.manifest_key(RUN), layout.pointer_key(RUN), layout.patch_key(RUN, 11),
                layout.rollout_key(RUN, 11, "w1", "g0010")):
        assert after[key] == before[key]
    assert keys(store, layout.stats_prefix(RUN)) == [k for k in before if k.startswith(layout.stats_prefix(RUN))]
    for k in gone:  # nothing at or above the newest kept anchor, except stale rollouts below the window
        v = int(k.split("/")[2][1:].split(".")[0])
        assert v < (8 if not k.startswith(layout.rollouts_prefix(RUN)) else 11 - 3)


def test_dry_run_task_deletes_nothing(file_store, tmp_path):
    build_run(file_store, RUN, pointer=11, anchors=[1, 4, 8], workers=WORKERS)
    before = keys(file_store, layout.run_prefix(RUN))
    out = subprocess.run([sys.executable, "-m", "invoke", "gc", "--run", RUN, "--keep-anchors", "1", "--dry-run",
                          "--store", file_store.url], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[dry run]" in out.stdout and f"would delete {layout.anchor_manifest_key(RUN, 1)}" in out.stdout
    assert keys(file_store, layout.run_prefix(RUN)) == before
    out = subprocess.run([sys.executable, "-m", "invoke", "gc", "--run", RUN, "--keep-anchors", "1",
                          "--store", file_store.url], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert list_anchors(file_store, RUN) == [8] and "deleted" in out.stdout
    joinable(file_store, RUN)


def test_interrupted_gc_leaves_a_joinable_run(store, built):
    plan = plan_gc(store, RUN, keep_anchors=1)
    for key in plan.keys[: len(plan.keys) // 2]:  # a crash half-way through
        store.delete(key)
    assert joinable(store, RUN) == (8, [9, 10, 11])
    apply_gc(store, plan_gc(store, RUN, keep_anchors=1))  # a second run finishes the job
    assert joinable(store, RUN) == (8, [9, 10, 11])


def test_plan_from_an_older_pointer_stays_safe(store, built):
    plan = plan_gc(store, RUN, keep_anchors=1)
    store.put(layout.patch_key(RUN, 12), b"patch")
    store.put(layout.anchor_manifest_key(RUN, 12), b"{}")
    store.put(layout.anchor_shard_key(RUN, 12, 1), b"x")
    store.put(layout.pointer_key(RUN), json.dumps({"version": 12, "published_at": 0}).encode())
    apply_gc(store, plan)  # the pointer moved on meanwhile
    assert list_anchors(store, RUN) == [8, 12]
    assert joinable(store, RUN) == (12, [])


def test_refusals(store, built):
    with pytest.raises(GcError, match="at least 1"):
        plan_gc(store, RUN, keep_anchors=0)
    with pytest.raises(GcError, match="no pointer"):
        plan_gc(store, "not-a-run", keep_anchors=1)
    store.delete(layout.anchor_manifest_key(RUN, 1))
    store.delete(layout.anchor_manifest_key(RUN, 4))
    store.delete(layout.anchor_manifest_key(RUN, 8))
    with pytest.raises(GcError, match="no anchor at or below the pointer"):
        plan_gc(store, RUN, keep_anchors=1)


def test_nothing_to_do_on_a_young_run(store):
    build_run(store, RUN, pointer=3, anchors=[1], workers={"w": [1, 2, 3]})
    plan = plan_gc(store, RUN, keep_anchors=2)
    assert plan.keys == [] and plan.bytes_freed == 0
