"""Reconstructor and verify: cold join + follow, bit-exact; forgeries and damage refused, last good state kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from weightsync_helpers import TinyPolicy, assert_same_bits, make_run

from trainer.publish.publisher import Publisher
from worker_contract import layout, signing
from worker_contract.anchor import read_manifest
from worker_contract.manifest import ContractMismatch
from worker_contract.planes import get_plane
from worker_contract.pointer import make_pointer
from worker_contract.pulse import encode_patch, read_header, sign_patch
from worker_contract.pulse.format import pack, split
from worker_contract.reconstruct import Reconstructor, SyncError
from worker_contract.verify import verify_run

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]


def _published(store, plane="bf16", n=5, anchor_interval=3):
    manifest, key = make_run(store, plane=plane, anchor_interval=anchor_interval)
    pub = Publisher(store, manifest, key, anchor_interval=anchor_interval, progress=False)
    policy = TinyPolicy()
    states = {pub.publish_anchor(policy.state()).version: get_plane(plane).from_hf(policy.state())}
    for _ in range(n - 1):
        policy.step()
        states[pub.publish(policy.state()).version] = get_plane(plane).from_hf(policy.state())
    return manifest, key, pub, policy, states


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_join_then_follow_is_bit_exact(store, plane):
    manifest, key, pub, policy, states = _published(store, plane=plane)
    seen = []
    rec = Reconstructor(store, manifest.run, plane=plane, n_samples=8, public_key=manifest.trainer_public_key,
                        progress=lambda stage, done, total: seen.append((stage, done, total)))
    version, state = rec.join()
    assert version == 5
    assert_same_bits(state, states[5])
    # cold join starts at the newest anchor at or below the pointer (v4), then one patch
    assert seen[-1] == ("patches", 5, 5) and [s for s in seen if s[0] == "patches"] == [("patches", 5, 5)]
    assert rec.follow() is None
    for _ in range(2):
        policy.step()
        states[pub.publish(policy.state()).version] = get_plane(plane).from_hf(policy.state())
    version, state = rec.follow()
    assert version == 7
    assert_same_bits(state, states[7])
    dense = get_plane(plane).to_dense(state)
    assert set(dense) == set(policy.state())


def test_lagging_follower_holds_each_version_exactly_k_behind(store):
    """follow(behind=k) reaches pointer - k and no further, bit-exact with what was published there; a join
    on a run younger than the lag holds the oldest anchor."""
    manifest, key, pub, policy, states = _published(store, n=1)
    rec = Reconstructor(store, manifest.run, plane="bf16", public_key=manifest.trainer_public_key)
    assert rec.join(behind=2)[0] == 1  # only v1 exists
    for pointer in range(2, 9):
        policy.step()
        states[pub.publish(policy.state()).version] = get_plane("bf16").from_hf(policy.state())
        got = rec.follow(behind=2)
        assert (got is None) == (pointer <= 3)
        assert rec.version == max(1, pointer - 2)
        assert_same_bits(rec.state, states[rec.version])
    cold = Reconstructor(store, manifest.run, plane="bf16", public_key=manifest.trainer_public_key)
    version, state = cold.join(behind=3)  # v5: entered at the anchor v4 (interval 3), one patch
    assert version == 5
    assert_same_bits(state, states[5])


def test_contract_mismatch_is_refused_naming_the_value(file_store):
    manifest, *_ = _published(file_store, n=1)
    with pytest.raises(ContractMismatch, match="DRL_PULSE_PLANE='int8g64'.*set DRL_PULSE_PLANE=bf16"):
        Reconstructor(file_store, manifest.run, plane="int8g64")
    with pytest.raises(ContractMismatch, match="DRL_N_SAMPLES=4.*n_samples=8"):
        Reconstructor(file_store, manifest.run, plane="bf16", n_samples=4)
    with pytest.raises(ValueError, match="known: bf16, int8g64"):
        Reconstructor(file_store, manifest.run, plane="fp4")
    other = signing.public_key_b64(signing.generate_private_key())
    with pytest.raises(ContractMismatch, match="join card"):
        Reconstructor(file_store, manifest.run, plane="bf16", public_key=other)


def _follower(store):
    manifest, key, pub, policy, states = _published(store, n=2)
    rec = Reconstructor(store, manifest.run, plane="bf16")
    assert rec.join()[0] == 2
    return manifest, key, pub, policy, states, rec


def _still_good(rec, states):
    assert rec.version == 2
    assert_same_bits(rec.state, states[2])


def test_forged_pointer_is_refused(store):
    manifest, key, pub, policy, states, rec = _follower(store)
    forger = signing.generate_private_key()
    forged = make_pointer(manifest.run, 3, 1, "sha256:" + "1" * 64, forger)
    store.put(layout.pointer_key(manifest.run), forged.to_bytes())
    with pytest.raises(SyncError, match="pointer refused"):
        rec.follow()
    _still_good(rec, states)


def test_forged_patch_is_refused_and_last_good_state_kept(store):
    manifest, key, pub, policy, states, rec = _follower(store)
    policy.step()
    v = pub.publish(policy.state()).version
    raw = store.get(layout.patch_key(manifest.run, v))
    store.delete(layout.patch_key(manifest.run, v))
    store.put(layout.patch_key(manifest.run, v), sign_patch(raw, signing.generate_private_key()))
    with pytest.raises(SyncError, match="does not verify"):
        rec.follow()
    _still_good(rec, states)
    with pytest.raises(SyncError):
        Reconstructor(store, manifest.run, plane="bf16").join()


@pytest.mark.parametrize("lie_at", ["the last patch", "a patch before the last"])
def test_a_signed_patch_that_builds_another_state_than_its_digest_is_refused(store, lie_at):
    """Every step of a walk is hashed against its signed result digest (DESIGN: digests and signatures at every
    step): a patch signed by the run's key whose body builds another state than its digest names (a trainer
    bug) is refused by name, last in the walk or not, and the follower keeps the state it had."""
    import numpy as np

    manifest, key, pub, policy, states = _published(store, n=2, anchor_interval=10)
    rec = Reconstructor(store, manifest.run, plane="bf16", public_key=manifest.trainer_public_key)
    assert rec.join()[0] == 2
    for _ in range(2):
        policy.step()
        states[pub.publish(policy.state()).version] = get_plane("bf16").from_hf(policy.state())
    # v3's patch, rebuilt to make v3 with one element off where v4 leaves it as it is, under v3's true digest
    name = next(n for n in states[3] if states[3][n].size > 1)
    same = np.flatnonzero(states[3][name].reshape(-1).view(np.uint16) == states[4][name].reshape(-1).view(np.uint16))
    wrong = {n: a.copy() for n, a in states[3].items()}
    wrong[name].reshape(-1).view(np.uint16)[same[0]] ^= 1
    true_header = read_header(store.get(layout.patch_key(manifest.run, 3)))
    _hb, header, _sig, body = split(encode_patch(states[2], wrong, base_version=2, target_version=3))
    lie = pack(header.model_copy(update={"result_digest": true_header.result_digest,
                                         "base_digest": true_header.base_digest}), bytes(body))
    store.delete(layout.patch_key(manifest.run, 3))
    store.put(layout.patch_key(manifest.run, 3), sign_patch(lie, key))
    if lie_at == "the last patch":  # the pointer back at v3 (the test's own key moves it)
        store.put(layout.pointer_key(manifest.run),
                  make_pointer(manifest.run, 3, 1, true_header.result_digest, key).to_bytes())
    with pytest.raises(SyncError, match="^v3: the patch result does not match the patch's result digest"):
        rec.follow()
    _still_good(rec, states)


def test_forged_or_damaged_anchor_is_refused(file_store):
    manifest, key, *_ = _published(file_store, n=1)
    mkey = layout.anchor_manifest_key(manifest.run, 1)
    good = file_store.get(mkey)
    m = read_manifest(file_store, manifest.run, 1, manifest.trainer_public_key)
    forged = m.model_copy(update={"signature": signing.sign(signing.generate_private_key(), m.signing_bytes())})
    file_store.put(mkey, forged.to_bytes())
    with pytest.raises(SyncError, match="manifest refused"):
        Reconstructor(file_store, manifest.run, plane="bf16").join()
    file_store.put(mkey, good)
    skey = layout.anchor_shard_key(manifest.run, 1, 0)
    shard = bytearray(file_store.get(skey))
    shard[-1] ^= 1
    file_store.put(skey, bytes(shard))
    with pytest.raises(SyncError, match="does not match its manifest digest"):
        Reconstructor(file_store, manifest.run, plane="bf16").join()


def test_manifest_of_another_format_is_refused_naming_it(file_store):
    """An anchor written by a format-1 publisher (sha256 digests) is refused by name, not half-read."""
    import json

    manifest, *_ = _published(file_store, n=1)
    mkey = layout.anchor_manifest_key(manifest.run, 1)
    raw = json.loads(file_store.get(mkey))
    assert raw["format"] == 2 and raw["digest_alg"] == "blake3" and raw["state_digest"].startswith("blake3:")
    raw["format"] = 1
    file_store.put(mkey, json.dumps(raw).encode())
    with pytest.raises(SyncError, match="anchor format 1; this reader knows format 2"):
        Reconstructor(file_store, manifest.run, plane="bf16").join()


def _cli(store_url: str, run: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker_contract", "verify", "--store", store_url, "--run", run],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_verify_cli_exit_codes(file_store):
    manifest, key, pub, policy, states = _published(file_store, n=4, anchor_interval=2)
    ok = _cli(file_store.url, manifest.run)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.strip().splitlines()
    assert len(lines) == 5 and lines[-1].endswith(": OK") and "0 failures" in lines[-1]
    assert lines[0].startswith("v1") and "anchor" in lines[0] and "patch" in lines[1]
    pkey = layout.patch_key(manifest.run, 2)
    raw = bytearray(file_store.get(pkey))
    raw[-2] ^= 0x10
    file_store.put(pkey, bytes(raw))
    bad = _cli(file_store.url, manifest.run)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "corrupted" in bad.stdout
    assert _cli("ftp://nowhere", manifest.run).returncode == 2


def test_verify_on_s3(s3_store, moto_server):
    manifest, *_ = _published(s3_store, n=3, anchor_interval=2)
    assert verify_run(s3_store, manifest.run, out=lambda s: None)
    res = _cli(s3_store.url, manifest.run, env=moto_server.env())
    assert res.returncode == 0, res.stdout + res.stderr
