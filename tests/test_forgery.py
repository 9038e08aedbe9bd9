"""Forgery: anyone holding worker credentials can write any key of the bucket, but not sign as the trainer.
Pointers, patches and anchor manifests written that way (direct store writes, on both backends) are
refused by the reconstructor, which keeps its last good version bit for bit; the trainer replaces a forged
pointer with its own (never behind the last valid one) and takes back versions squatted with objects it did
not sign, while its own crashed attempts are skipped, never reused; a replaced run.json is refused by a
joiner holding the join card's key; and the reference worker, a real process, keeps producing rollouts on
its last good version."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
from learner_fixtures import manifest
from test_worker import tiny_model_dir  # noqa: F401  (fixture: a tiny model with a tokenizer)

from trainer.publish.publisher import Publisher
from worker_contract import layout
from worker_contract.anchor import AnchorManifest
from worker_contract.anchor import read_manifest as read_anchor_manifest
from worker_contract.manifest import ContractMismatch, create_or_resume
from worker_contract.pointer import Pointer, make_pointer, read_pointer
from worker_contract.pulse import encode_patch, sign_patch, verify_patch_signature
from worker_contract.reconstruct import Reconstructor, SyncError
from worker_contract.signing import fingerprint, generate_private_key, public_key_b64, sign
from worker_contract.verify import verify_run

RUN = "forge"


class Published:
    """A run with v1 (anchor), v2, v3 (patches) from the trainer, and a worker following it at v3."""

    def __init__(self, store):
        self.store = store
        self.key, self.evil = generate_private_key(), generate_private_key()
        self.man = create_or_resume(store, manifest(RUN, self.key), resume=False)
        self.pub = Publisher(store, self.man, self.key, anchor_interval=100, progress=False)
        g = torch.Generator().manual_seed(0)
        self.state = {"model.a.weight": torch.randn(64, 48, generator=g), "model.b.weight": torch.randn(48, generator=g)}
        self.pub.publish_anchor(self.state)
        for _ in range(2):
            self.bump()
        self.rec = Reconstructor(store, RUN, plane="bf16")
        assert self.rec.join()[0] == 3
        self.good = self.snapshot()

    def bump(self) -> int:
        self.state["model.a.weight"][torch.randint(0, 64, (3,))] += 1.0
        self.last = self.pub.publish(self.state)
        return self.last.version

    def snapshot(self) -> tuple[int, str, dict[str, bytes]]:
        return self.rec.version, self.rec.digest, {k: v.tobytes() for k, v in self.rec.state.items()}

    def pointer(self) -> Pointer:
        return read_pointer(self.store, RUN, self.man.trainer_public_key)[0]

    def evil_patch(self, base_version: int, target: int, key=None) -> bytes:
        """A well-formed patch from the worker's own state to other weights, signed with the attacker's key
        (or with `key`: the run's key makes it a crashed attempt of the trainer)."""
        old = self.rec.state
        new = {k: v.copy() for k, v in old.items()}
        new["model.b.weight"][:] = 0
        return sign_patch(encode_patch(old, new, base_version=base_version, target_version=target), key or self.evil)

    def evil_anchor(self, version: int, key=None) -> None:
        """A complete anchor (shard and manifest) of other weights at `version`, signed with `key`."""
        from worker_contract.anchor import write_anchor
        from worker_contract.planes import get_plane

        state = get_plane("bf16").from_hf({k: v * 0 for k, v in self.state.items()})
        write_anchor(self.store, RUN, version, "bf16", state, key or self.evil)

    def verified(self) -> list[str]:
        lines: list[str] = []
        assert verify_run(self.store, RUN, out=lines.append), "\n".join(lines)
        return lines

    def same_as_trainer(self, state) -> bool:
        mine = self.pub._base
        return all(np.array_equal(state[k].view(np.uint16), np.asarray(mine[k]).view(np.uint16)) for k in mine)


@pytest.fixture
def pub(store):
    return Published(store)


def forged_pointers(p: Published) -> dict[str, bytes]:
    cur = p.pointer()
    digest = cur.result_digest
    signed_by_evil = make_pointer(RUN, cur.version + 1, cur.anchor_version, digest, p.evil).to_bytes()
    unsigned = Pointer(run=RUN, version=cur.version + 1, anchor_version=1, result_digest=digest,
                       published_at=time.time()).to_bytes()
    altered = json.loads(cur.to_bytes())
    altered["version"] += 5  # the trainer's own signature, over other contents
    return {"signed by another key": signed_by_evil, "unsigned": unsigned,
            "genuine signature, altered version": json.dumps(altered).encode(),
            "not JSON": b"\x00garbage"}


def test_forged_pointers_are_refused_and_the_last_good_version_is_kept(pub):
    for name, blob in forged_pointers(pub).items():
        pub.store.put(layout.pointer_key(RUN), blob)  # a direct write with worker credentials
        with pytest.raises(SyncError, match="pointer|not a valid"):
            pub.rec.follow()
        assert pub.snapshot() == pub.good, name
        with pytest.raises(SyncError):
            Reconstructor(pub.store, RUN, plane="bf16").join()
        lines: list[str] = []
        assert not verify_run(pub.store, RUN, out=lines.append), name
        assert "FAIL current.json" in lines[0], (name, lines)


def test_a_deleted_pointer_fails_verify_where_versions_were_published(pub):
    """Worker credentials can delete current.json: verify names it, rather than reporting an empty run."""
    pub.store.delete(layout.pointer_key(RUN))
    lines: list[str] = []
    assert not verify_run(pub.store, RUN, out=lines.append)
    assert "FAIL current.json is missing" in lines[0] and "v3" in lines[0], lines


def test_a_replayed_older_pointer_does_not_move_a_follower_back(pub):
    old = read_pointer(pub.store, RUN, None)[0]
    pub.bump()
    assert pub.rec.follow()[0] == 4
    pub.store.put(layout.pointer_key(RUN), old.to_bytes())  # a genuine, signed, older pointer put back
    assert pub.rec.follow() is None and pub.rec.version == 4


@pytest.mark.parametrize("how", ["bit flip", "re-signed by another key", "other weights, another key"])
def test_a_tampered_patch_is_refused_and_the_last_good_version_is_kept(pub, how):
    v4 = pub.bump()
    key = layout.patch_key(RUN, v4)
    genuine = pub.store.get(key)
    if how == "bit flip":
        forged = bytearray(genuine)
        forged[len(forged) // 2] ^= 0x01
        forged = bytes(forged)
    elif how == "re-signed by another key":
        forged = sign_patch(genuine, pub.evil)  # the trainer's bytes, the attacker's signature
    else:
        forged = pub.evil_patch(3, 4)
    assert forged != genuine
    pub.store.put(key, forged)  # overwritten with worker credentials (plain put)
    with pytest.raises(SyncError, match="v4"):
        pub.rec.follow()
    assert pub.snapshot() == pub.good
    with pytest.raises(SyncError):
        Reconstructor(pub.store, RUN, plane="bf16").join()
    # the trainer goes on; once it publishes an anchor the follower gets past the damage to genuine weights
    pub.pub.anchor_interval = 1
    v5 = pub.bump()
    assert pub.rec.follow()[0] == v5
    mine = {k: np.asarray(v) for k, v in pub.pub._base.items()}
    assert all(np.array_equal(pub.rec.state[k].view(np.uint16), mine[k].view(np.uint16)) for k in mine)


SQUATS = ("garbage patch", "patch signed by another key", "the trainer's patch of another version",
          "anchor manifest signed by another key", "a stray object under the anchor")


def squat(p: Published, version: int, how: str) -> None:
    """Create objects at `version` with worker credentials (create-only, as a squatter racing ahead would)."""
    if how == "garbage patch":
        p.store.put_if_absent(layout.patch_key(RUN, version), b"PULSE? no")
    elif how == "patch signed by another key":
        p.store.put_if_absent(layout.patch_key(RUN, version), p.evil_patch(version - 1, version))
    elif how == "the trainer's patch of another version":  # genuinely signed, replayed under another number
        p.store.put_if_absent(layout.patch_key(RUN, version), p.store.get(layout.patch_key(RUN, 3)))
    elif how == "anchor manifest signed by another key":
        p.evil_anchor(version)
        with pytest.raises(Exception, match="signature|sign"):
            read_anchor_manifest(p.store, RUN, version, p.man.trainer_public_key)
    else:
        p.store.put_if_absent(layout.anchor_prefix(RUN, version) + "README.txt", b"taken")


@pytest.mark.parametrize("how", SQUATS)
def test_a_squatted_version_is_taken_back_and_followers_go_on(pub, how):
    """Workers can create the keys of the next version before the trainer does. Nothing there is signed by
    the run key for that version, so it is a squatter's: the trainer deletes it and publishes there."""
    squat(pub, 4, how)
    v = pub.bump()
    assert v == 4 and pub.last.kind == "patch" and pub.pointer().version == 4
    assert pub.last.stats["forged_versions_reclaimed"] == 1
    assert layout.anchor_prefix(RUN, 4) + "README.txt" not in pub.store.list_keys(layout.anchors_prefix(RUN))
    got = pub.rec.follow()
    assert got is not None and got[0] == 4 and pub.same_as_trainer(got[1])
    assert Reconstructor(pub.store, RUN, plane="bf16").join()[0] == 4
    pub.verified()


def test_a_squatter_on_the_next_100_versions_does_not_stop_publishing(pub):
    for v in range(4, 104):
        squat(pub, v, SQUATS[v % len(SQUATS)])
    published = [pub.bump() for _ in range(3)]
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    published.append(restarted.publish_anchor(pub.state).version)  # a restart meets the squatter too
    assert published == [4, 5, 6, 7]
    assert pub.pub.forged_versions_reclaimed == 3 and restarted.forged_versions_reclaimed == 1
    assert pub.pointer().version == 7
    for v in published[:3]:  # every published version is the trainer's own, signed
        verify_patch_signature(pub.store.get(layout.patch_key(RUN, v)), pub.man.trainer_public_key)
    read_anchor_manifest(pub.store, RUN, 7, pub.man.trainer_public_key)
    lines = pub.verified()
    assert "pointer v7" in lines[-1] and "77 beyond the pointer, 0 failures: OK" in lines[-1], lines[-1]
    got = pub.rec.follow()
    assert got is not None and got[0] == 7
    assert Reconstructor(pub.store, RUN, plane="bf16").join()[0] == 7


def test_the_trainers_own_crashed_attempts_are_skipped_never_reused(pub):
    """What the run key signed at a version (a crashed attempt of the trainer: a patch at v4, an anchor at
    v6) and anchor shards without a manifest (an interrupted anchor upload at v5, which nothing signed
    tells from a squatter's) are never overwritten: the trainer publishes above them."""
    pub.store.put_if_absent(layout.patch_key(RUN, 4), pub.evil_patch(3, 4, key=pub.key))
    pub.evil_anchor(5, key=pub.key)
    pub.store.delete(layout.anchor_manifest_key(RUN, 5))
    pub.evil_anchor(6, key=pub.key)
    before = {k: pub.store.get(k) for k in pub.store.list_keys(layout.run_prefix(RUN)) if "/v0" in k}
    assert pub.bump() == 7 and pub.last.kind == "anchor"
    assert pub.rec.follow()[0] == 7
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    pub.store.put_if_absent(layout.patch_key(RUN, 8), pub.evil_patch(7, 8, key=pub.key))  # crashed again
    assert restarted.publish_anchor(pub.state).version == 9
    assert pub.pub.forged_versions_reclaimed == restarted.forged_versions_reclaimed == 0
    assert all(pub.store.get(k) == data for k, data in before.items())  # left as they were
    assert pub.rec.follow()[0] == 9 and pub.rec.digest == pub.pointer().result_digest
    pub.verified()


@pytest.mark.parametrize("what", ["manifest signed by another key", "shard bytes"])
def test_a_forged_anchor_is_refused_by_a_cold_joiner(pub, what):
    if what == "manifest signed by another key":
        key = layout.anchor_manifest_key(RUN, 1)
        m = AnchorManifest.model_validate_json(pub.store.get(key))
        m = m.model_copy(update={"created_at": m.created_at + 1})
        m = m.model_copy(update={"signature": sign(pub.evil, m.signing_bytes())})
        pub.store.put(key, m.model_dump_json().encode())
    else:
        key = layout.anchor_shard_key(RUN, 1, 0)
        data = bytearray(pub.store.get(key))
        data[-3] ^= 0xFF
        pub.store.put(key, bytes(data))
    with pytest.raises(SyncError):
        Reconstructor(pub.store, RUN, plane="bf16").join()
    pub.bump()
    assert pub.rec.follow()[0] == 4  # a follower already past the anchor is not affected


def test_a_replaced_run_json_is_refused_by_a_joiner_holding_the_join_card_key(store):
    genuine = generate_private_key()
    create_or_resume(store, manifest(RUN, genuine), resume=False)
    # the attacker replaces run.json with one naming their key, and publishes weights of their own
    evil = generate_private_key()
    store.put(layout.manifest_key(RUN), manifest(RUN, evil).model_dump_json().encode())
    evil_man = manifest(RUN, evil)
    Publisher(store, evil_man, evil, anchor_interval=10, progress=False).publish_anchor({"w": torch.zeros(8)})
    assert Reconstructor(store, RUN, plane="bf16").join()[0] == 1  # a joiner who trusts the bucket is fooled
    with pytest.raises(ContractMismatch, match="another key|key other"):
        Reconstructor(store, RUN, plane="bf16", public_key=public_key_b64(genuine))
    from worker_contract.worker.loop import check_trainer_key

    with pytest.raises(ContractMismatch, match="DRL_TRAINER_KEY_FINGERPRINT"):
        check_trainer_key(evil_man, fingerprint(public_key_b64(genuine)))
    check_trainer_key(evil_man, fingerprint(public_key_b64(evil)))  # the matching card passes


@pytest.mark.parametrize("forgery", ["signed by another key", "unsigned", "genuine signature, altered version",
                                     "not JSON", "signed by another key, far ahead"])
def test_the_trainer_publishes_over_a_forged_pointer(pub, forgery, caplog):
    """A current.json written with worker credentials does not stop the trainer: its next publish replaces it
    by compare-and-swap, one version above the last valid pointer (not above the forgery's claim), with a
    warning and a count; followers that refused the forgery go on from there."""
    blobs = forged_pointers(pub)
    blobs["signed by another key, far ahead"] = make_pointer(RUN, 10**6, 1, pub.pointer().result_digest,
                                                             pub.evil).to_bytes()
    pub.store.put(layout.pointer_key(RUN), blobs[forgery])
    assert pub.pub.current_version() == 3  # the last valid version, not the forgery's
    with pytest.raises(SyncError):
        pub.rec.follow()
    with caplog.at_level("WARNING", logger="trainer.publish.publisher"):
        v = pub.bump()
    assert v == 4 and pub.pointer().version == 4 and pub.last.kind == "patch"
    assert pub.last.stats["forged_pointer_reclaimed"] == 1
    assert "current.json did not verify under the run key" in caplog.text
    assert pub.rec.follow()[0] == 4 and pub.same_as_trainer(pub.rec.state)
    assert pub.bump() == 5 and pub.last.stats["forged_pointer_reclaimed"] == 1  # nothing more to reclaim
    pub.verified()


def test_a_restarted_trainer_publishes_over_a_forged_pointer_above_everything_it_signed(pub):
    """A restart has no memory of what it made visible: over a forged pointer it goes above the newest
    version the run key signed (here a crashed attempt at v4 above the last valid pointer, v3), and above
    squatters' objects, which do not count."""
    pub.store.put_if_absent(layout.patch_key(RUN, 4), pub.evil_patch(3, 4, key=pub.key))
    squat(pub, 6, "patch signed by another key")
    pub.store.put(layout.pointer_key(RUN), forged_pointers(pub)["unsigned"])
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    assert restarted.current_version() == 4
    done = restarted.publish_anchor(pub.state)
    assert done.version == 5
    assert done.stats["forged_pointer_reclaimed"] == 1 and pub.pointer().version == 5
    assert pub.rec.follow()[0] == 5
    pub.verified()


def test_a_forged_pointer_before_the_first_publish_is_replaced_by_v1(store):
    key = generate_private_key()
    man = create_or_resume(store, manifest(RUN, key), resume=False)
    store.put(layout.pointer_key(RUN), make_pointer(RUN, 7, 1, "blake3:" + "0" * 64, generate_private_key()).to_bytes())
    pub = Publisher(store, man, key, anchor_interval=10, progress=False)
    assert pub.current_version() is None
    assert pub.publish_anchor({"model.w": torch.ones(64)}).version == 1
    assert read_pointer(store, RUN, man.trainer_public_key)[0].version == 1
    assert verify_run(store, RUN, out=lambda line: None)


@pytest.mark.integration
def test_the_reference_worker_keeps_producing_on_its_last_good_version(tmp_path, tiny_model_dir):  # noqa: F811
    """A real worker process (joined with the join card's fingerprint) meets a forged pointer: it refuses
    it, stays on v1 and keeps uploading groups there. A worker given another fingerprint never joins."""
    from test_worker import RUN as WRUN
    from test_worker import _publish_run, _spawn

    from worker_contract.schema import decode_record
    from worker_contract.store.file import FileStore
    from worker_contract.worker.loop import WorkerSettings

    store = FileStore(tmp_path / "bucket")
    man, _, _ = _publish_run(store, tiny_model_dir)
    card = {"DRL_TRAINER_KEY_FINGERPRINT": fingerprint(man.trainer_public_key)}

    def records() -> list:
        return [decode_record(store.get(k)) for k in store.list_keys(layout.rollouts_prefix(WRUN))]

    def wait_records(n: int, proc) -> None:
        deadline = time.monotonic() + 180
        while len(store.list_keys(layout.rollouts_prefix(WRUN))) < n:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, f"fewer than {n} records within 180 s"
            time.sleep(0.2)

    p = _spawn(store, tiny_model_dir, env=card)
    try:
        wait_records(1, p)
        pointer = read_pointer(store, WRUN, man.trainer_public_key)[0]
        evil = generate_private_key()
        store.put(layout.pointer_key(WRUN), make_pointer(WRUN, 2, 1, pointer.result_digest, evil).to_bytes())
        forged_at, before = time.monotonic(), len(records())
        wait_records(before + 3, p)  # still producing, after the forgery
        follow_s = WorkerSettings.model_fields["follow_interval_s"].default
        time.sleep(max(0.0, forged_at + 8 * follow_s - time.monotonic()))  # the background follower met the forgery
        p.send_signal(__import__("signal").SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert "not following the pointer, staying on v1" in err and "pointer refused" in err
    assert {r.policy_version for r in records()} == {1}

    q = _spawn(store, tiny_model_dir, env={"DRL_TRAINER_KEY_FINGERPRINT": fingerprint(public_key_b64(evil))})
    _, err = q.communicate(timeout=120)
    assert q.returncode == 3 and "DRL_TRAINER_KEY_FINGERPRINT" in err, err


def test_keys_the_layout_does_not_make_stop_neither_the_trainer_nor_verify(pub):
    pub.store.put(layout.versions_prefix(RUN) + "v4-evil.pulse", b"x")
    pub.store.put(layout.anchors_prefix(RUN) + "latest/manifest.json", b"{}")
    pub.store.put(layout.pointer_key(RUN), forged_pointers(pub)["unsigned"])  # the trainer lists the bucket
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    assert restarted.publish_anchor(pub.state).version == 4
    assert pub.bump() == 5
    assert Reconstructor(pub.store, RUN, plane="bf16").join()[0] == 5  # anchor v4 named by the pointer
    pub.verified()


def test_a_follower_passes_keys_the_layout_does_not_make(pub):
    pub.store.put(layout.anchors_prefix(RUN) + "latest/manifest.json", b"{}")
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    assert restarted.publish_anchor(pub.state).version == 4
    assert pub.rec.follow()[0] == 4


@pytest.mark.integration
def test_a_bumped_pointer_neither_crashes_workers_nor_outlives_a_trainer_start(tmp_path, tiny_model_dir):  # noqa: F811
    """The genuine pointer with its version bumped (what anyone with worker credentials can write): a joining
    worker, a real process, says so in one sentence and waits for a valid pointer (with a short --wait it
    exits 2 with one line, never a traceback); a trainer that starts (trainer.run_init.create_run, what every
    launch runs) reclaims the pointer to its newest signed version and says so; the waiting worker then joins
    there and uploads."""
    import signal

    from test_worker import RUN as WRUN
    from test_worker import _spawn

    from tests.worker_fixtures import publish_run
    from trainer.run_init import create_run
    from worker_contract.signing import save_private_key
    from worker_contract.store.file import FileStore

    store = FileStore(tmp_path / "bucket")
    cfg, man, pub, model = publish_run(store, tiny_model_dir, WRUN, n_samples=4)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    assert pub.publish(model.state_dict()).version == 2
    altered = json.loads(store.get(layout.pointer_key(WRUN)))
    altered["version"] += 5  # the trainer's signature over other contents
    store.put(layout.pointer_key(WRUN), json.dumps(altered).encode())

    quick = _spawn(store, tiny_model_dir, "--wait", "2")
    _, err = quick.communicate(timeout=120)
    assert quick.returncode == 2, err
    assert "Traceback" not in err and "worker error: run 'wk-run' had no valid pointer within 2 s" in err, err
    assert len([line for line in err.splitlines() if "worker error" in line]) == 1

    p = _spawn(store, tiny_model_dir, "--wait", "300")
    lines: list[str] = []  # the worker's stderr, read as it comes (the worker must have seen the forgery first)
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120  # the worker builds its model before it reads the pointer
        while not any("not joining until" in line for line in lines):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        key_file = tmp_path / "trainer.key"
        save_private_key(pub.key, key_file)
        start = create_run(cfg, store, tiny_model_dir, key_file, publish_base=False)
        assert start.reclaimed and "reclaimed it: the signed pointer names v2 (anchor v1)" in start.reclaimed
        ptr = read_pointer(store, WRUN, man.trainer_public_key)[0]
        assert (ptr.version, ptr.anchor_version) == (2, 1)
        assert create_run(cfg, store, tiny_model_dir, key_file, publish_base=False).reclaimed is None
        deadline = time.monotonic() + 180
        while not store.list_keys(layout.rollouts_prefix(WRUN)):
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "no record within 180 s of the reclaim"
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        reader.join(timeout=60)
        err = "".join(lines)
    finally:
        if p.poll() is None:  # the test started it; end it by PID
            p.kill()
            p.wait()
    assert p.returncode == 0 and "Traceback" not in err, err
    assert err.count("not joining until the trainer writes a valid pointer") == 1, err
    assert "joined run 'wk-run' at v2" in err


def test_reclaim_on_start_names_the_newest_complete_signed_chain(pub, caplog):
    """Over a forged pointer a starting trainer names the newest version reached from a signed anchor through
    signed, chained patches: not a squatter's patch (v4 signed by another key), not the trainer's patch
    replayed under another number, not a version whose chain has a gap (v6, no v5). A valid pointer, or none,
    is left alone."""
    restarted = Publisher(pub.store, pub.man, pub.key, anchor_interval=100, progress=False)
    assert restarted.reclaim_pointer() is None
    squat(pub, 4, "patch signed by another key")
    squat(pub, 5, "the trainer's patch of another version")
    pub.store.put_if_absent(layout.patch_key(RUN, 7), pub.evil_patch(6, 7, key=pub.key))  # v6 missing: a gap
    pub.store.put(layout.pointer_key(RUN), forged_pointers(pub)["genuine signature, altered version"])
    with caplog.at_level("WARNING", logger="trainer.publish.pointer"):
        said = restarted.reclaim_pointer()
    assert said and "reclaimed it: the signed pointer names v3 (anchor v1)" in said and said in caplog.text
    assert (pub.pointer().version, pub.pointer().anchor_version) == (3, 1)
    assert restarted.forged_pointer_reclaimed == 1 and restarted.reclaim_pointer() is None
    assert pub.rec.follow() is None and pub.rec.version == 3  # the follower's version: nothing moved back
    pub.store.delete(layout.pointer_key(RUN))
    assert restarted.reclaim_pointer() is None
