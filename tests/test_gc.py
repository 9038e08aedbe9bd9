"""`gc`: deletes only what no joiner can need. After it, `python -m worker_contract verify` passes and a cold
join reconstructs exactly the state it reconstructed before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from opsbucket import build_run
from weightsync_helpers import TinyPolicy, assert_same_bits

from infra.ops.gc import GcError, apply_gc, plan_gc
from trainer.publish.publisher import Publisher
from worker_contract import layout, signing
from worker_contract.anchor import anchor_versions
from worker_contract.pointer import make_pointer
from worker_contract.reconstruct import Reconstructor
from worker_contract.verify import verify_run

REPO = Path(__file__).resolve().parent.parent
RUN = "ops-gc-a"
# pointer v11, anchors at 1, 5, 9 (every 4 versions); every version 1..11 has rollouts
WORKERS = {"w1": list(range(1, 12)), "w2": [3, 6, 9, 10, 11]}


@pytest.fixture
def built(store):
    b = build_run(store, RUN, pointer=11, anchor_interval=4, workers=WORKERS)
    store.put(layout.anchor_shard_key(RUN, 12, 0), b"partial")  # no manifest yet: a publisher mid-way
    return b


def cold_join(store, run=RUN):
    return Reconstructor(store, run, plane="bf16", n_samples=8).join()


def verify_cli(store, request, run=RUN) -> subprocess.CompletedProcess:
    """`python -m worker_contract verify` as a process (with the S3 server's environment for s3://)."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}  # the test's temporary HOME
    if store.url.startswith("s3://"):
        env.update(request.getfixturevalue("moto_server").env())
    return subprocess.run([sys.executable, "-m", "worker_contract", "verify", "--store", store.url, "--run", run],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def keys(store, prefix):
    return [o.key for o in store.list(prefix)]


def versions_of(store, prefix):
    return sorted({int(k[len(prefix):].split("/")[0].split(".")[0][1:]) for k in keys(store, prefix)})


def test_keep_one_anchor_then_verify_and_cold_join(store, built, request):
    before = cold_join(store)
    plan = plan_gc(store, RUN, keep_anchors=1)
    assert plan.kept_anchors == [9] and plan.pointer_anchor == 9  # v12 has no manifest: untouched
    apply_gc(store, plan)
    assert anchor_versions(store, RUN) == [9]
    assert keys(store, layout.anchor_prefix(RUN, 1)) == keys(store, layout.anchor_prefix(RUN, 5)) == []
    assert keys(store, layout.anchor_prefix(RUN, 12)) == [layout.anchor_shard_key(RUN, 12, 0)]
    assert versions_of(store, layout.versions_prefix(RUN)) == [9, 10, 11]
    assert versions_of(store, layout.rollouts_prefix(RUN)) == [8, 9, 10, 11]  # 11 - 3: oldest still accepted
    out = verify_cli(store, request)
    assert out.returncode == 0, out.stdout + out.stderr
    after = cold_join(store)
    assert after[0] == before[0] == 11
    assert_same_bits(after[1], before[1])


def test_keep_two_anchors_keeps_the_older_path_too(store, built):
    apply_gc(store, plan_gc(store, RUN, keep_anchors=2))
    assert anchor_versions(store, RUN) == [5, 9]
    assert versions_of(store, layout.versions_prefix(RUN)) == list(range(5, 12))
    assert verify_run(store, RUN, out=lambda s: None)
    assert cold_join(store)[0] == 11


def test_never_touches_manifest_pointer_stats_or_what_the_pointer_names(store, built):
    before = {o.key: o.etag for o in store.list(layout.run_prefix(RUN))}
    plan = plan_gc(store, RUN, keep_anchors=1)
    apply_gc(store, plan)
    after = {o.key: o.etag for o in store.list(layout.run_prefix(RUN))}
    gone = set(before) - set(after)
    assert gone == set(plan.keys) and gone
    for key in (layout.manifest_key(RUN), layout.pointer_key(RUN), layout.patch_key(RUN, 11),
                layout.anchor_manifest_key(RUN, 9), layout.rollout_key(RUN, 11, "w1", "g0010")):
        assert after[key] == before[key]
    assert keys(store, layout.stats_prefix(RUN)) == sorted(k for k in before if k.startswith(layout.stats_prefix(RUN)))
    for k in gone:  # nothing at or above the newest kept anchor; rollouts only below the staleness window
        v = int(k.split("/")[2][1:].split(".")[0])
        assert v < (9 if not k.startswith(layout.rollouts_prefix(RUN)) else 11 - 3), k


def test_dry_run_task_deletes_nothing_then_the_task_deletes(file_store, request):
    build_run(file_store, RUN, pointer=11, anchor_interval=4, workers=WORKERS)
    before = keys(file_store, layout.run_prefix(RUN))
    args = [sys.executable, "-m", "invoke", "gc", "--run", RUN, "--keep-anchors", "1", "--store", file_store.url]
    out = subprocess.run([*args, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[dry run]" in out.stdout and f"would delete {layout.anchor_manifest_key(RUN, 1)}" in out.stdout
    assert keys(file_store, layout.run_prefix(RUN)) == before
    # not a terminal and no --yes: it names what it would delete and deletes nothing
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "--yes" in out.stderr and f"{file_store.url}/{RUN}/" in out.stdout, out
    assert keys(file_store, layout.run_prefix(RUN)) == before
    out = subprocess.run([*args, "--yes"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert anchor_versions(file_store, RUN) == [9] and "deleted" in out.stdout
    assert verify_cli(file_store, request).returncode == 0


def test_interrupted_gc_leaves_a_verifiable_joinable_run(store, built):
    plan = plan_gc(store, RUN, keep_anchors=1)
    for i, key in enumerate(plan.keys):  # a crash may come after any deletion
        store.delete(key)
        if i % 4 == 0 and not key.startswith(layout.rollouts_prefix(RUN)):
            assert verify_run(store, RUN, out=lambda s: None), f"verify fails after deleting {key}"
            assert cold_join(store)[0] == 11
    apply_gc(store, plan_gc(store, RUN, keep_anchors=1))  # a second run finishes the (finished) job
    assert verify_run(store, RUN, out=lambda s: None) and cold_join(store)[0] == 11


def test_plan_from_an_older_pointer_stays_safe(store, built):
    plan = plan_gc(store, RUN, keep_anchors=1)
    store.delete(layout.anchor_shard_key(RUN, 12, 0))
    # the trainer restarts meanwhile and publishes a fresh anchor (v12) and moves the pointer to it
    pub = Publisher(store, built.manifest, built.key, anchor_interval=4, progress=False)
    assert pub.publish_anchor(TinyPolicy(seed=3).state()) == 12
    apply_gc(store, plan)
    assert anchor_versions(store, RUN) == [9, 12]
    assert verify_run(store, RUN, out=lambda s: None) and cold_join(store)[0] == 12


def test_refusals(store, built):
    with pytest.raises(GcError, match="at least 1"):
        plan_gc(store, RUN, keep_anchors=0)
    with pytest.raises(GcError, match="no run.json"):
        plan_gc(store, "not-a-run", keep_anchors=1)
    # a pointer signed by anybody but the trainer never steers a deletion
    forged = make_pointer(RUN, 40, 40, "sha256:" + "0" * 64, signing.generate_private_key())
    store.put(layout.pointer_key(RUN), forged.to_bytes())
    with pytest.raises(GcError, match="does not verify"):
        plan_gc(store, RUN, keep_anchors=1)


def test_pointer_anchor_missing_is_refused(store, built):
    store.delete(layout.anchor_manifest_key(RUN, 9))
    with pytest.raises(GcError, match="not a complete anchor"):
        plan_gc(store, RUN, keep_anchors=1)


@pytest.mark.parametrize("damage", ["shard-bytes", "shard-gone", "manifest-garbage"])
def test_pointer_anchor_damaged_deletes_nothing(store, built, damage):
    """The pointer's own anchor (v9) damaged: the older anchors and patches are the only route to the weights,
    so gc plans nothing (it once kept v9 and deleted v1, v5 and every patch below v9)."""
    if damage == "shard-bytes":
        store.put(layout.anchor_shard_key(RUN, 9, 0), b"x" * len(store.get(layout.anchor_shard_key(RUN, 9, 0))))
    elif damage == "shard-gone":
        store.delete(layout.anchor_shard_key(RUN, 9, 0))
    else:
        store.put(layout.anchor_manifest_key(RUN, 9), b"{not json")
    before = keys(store, layout.run_prefix(RUN))
    with pytest.raises(GcError, match="pointer's own anchor is damaged.*deletes nothing"):
        plan_gc(store, RUN, keep_anchors=1)
    assert keys(store, layout.run_prefix(RUN)) == before


def test_nothing_to_do_on_a_young_run(store):
    build_run(store, RUN, pointer=3, anchor_interval=4, workers={"w": [1, 2, 3]})
    plan = plan_gc(store, RUN, keep_anchors=2)
    assert plan.keys == [] and plan.bytes_freed == 0


def test_gc_after_a_resume_that_anchored_inside_the_collected_rollouts(file_store):
    """136 steps as an embedded run takes them: anchors every 20 versions, a resume at v134 (a new publisher
    anchors where it starts), the pointer at v138 and rollouts at every version. The rollouts sampled at the
    pointer's anchor (v134) are below pointer - staleness and go; gc's own check once took them for objects
    the pointer names and stopped with an AssertionError (exit 70)."""
    from opsbucket import manifest_for, record

    run = "ops-gc-long"
    key = signing.generate_private_key()
    manifest = manifest_for(run, staleness=3, anchor_interval=20, key=key)
    from worker_contract.manifest import create_or_resume

    create_or_resume(file_store, manifest, resume=False)
    policy = TinyPolicy()
    pub = Publisher(file_store, manifest, key, anchor_interval=20, progress=False)
    assert pub.publish_anchor(policy.state()) == 1
    for v in range(2, 134):
        policy.step()
        assert pub.publish(policy.state()) == v
    resumed = Publisher(file_store, manifest, key, anchor_interval=20, progress=False)  # a rerun of the run
    assert resumed.publish_anchor(policy.state()) == 134
    for v in range(135, 139):
        policy.step()
        assert resumed.publish(policy.state()) == v
    for v in range(1, 139):
        file_store.put_if_absent(layout.rollout_key(run, v, "w1", f"g{v:04d}"), record(run, "w1", f"g{v:04d}", v, 0.0))
    assert anchor_versions(file_store, run) == [1, 21, 41, 61, 81, 101, 121, 134]
    args = [sys.executable, "-m", "invoke", "gc", "--run", run, "--keep-anchors", "2", "--store", file_store.url]
    out = subprocess.run([*args, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"would delete {layout.rollout_version_prefix(run, 134)}" in out.stdout
    plan = plan_gc(file_store, run, 2)
    assert plan.pointer_anchor == 134 and plan.kept_anchors == [121, 134]
    assert {layout.parse_rollout_key(k).version for k in plan.rollout_keys} == set(range(1, 135))
    assert subprocess.run([*args, "--yes"], cwd=REPO, capture_output=True, text=True, timeout=120).returncode == 0
    assert anchor_versions(file_store, run) == [121, 134]
    assert verify_run(file_store, run, out=lambda _l: None)
    assert Reconstructor(file_store, run, plane="bf16", n_samples=8).join()[0] == 138
