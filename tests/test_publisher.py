"""Publisher: anchors, signed patches and the pointer, in order, on the file store and on S3 (moto)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from weightsync_helpers import TinyPolicy, assert_same_bits, make_run

from trainer.publish.publisher import Publisher
from worker_contract import layout, signing
from worker_contract.anchor import anchor_versions, read_anchor, read_manifest
from worker_contract.planes import get_plane
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, read_pointer
from worker_contract.pulse import read_header, verify_patch_signature
from worker_contract.store.file import FileStore
from worker_contract.verify import verify_run

torch = pytest.importorskip("torch")


def test_publish_sequence_objects_pointer_and_stats(store):
    manifest, key = make_run(store, anchor_interval=2)
    pub = Publisher(store, manifest, key, anchor_interval=2, progress=False)
    policy = TinyPolicy()
    assert pub.current_version() is None
    first = pub.publish_anchor(policy.state())
    assert first.version == 1 and first.kind == "anchor" and first.stats["bytes"] > 0
    versions, done = [], first
    for _ in range(3):
        policy.step()
        done = pub.publish(policy.state())
        versions.append(done.version)
        assert pub.current_version() == versions[-1]
    assert versions == [2, 3, 4]
    assert anchor_versions(store, manifest.run) == [1, 3]
    stats = done.stats
    assert stats["kind"] == "patch" and stats["patch_bytes"] < stats["full_bytes"] / 4
    assert stats["encoder"] == "numpy"  # host tensors: the numpy encoder (CUDA ones take the torch one)
    assert 0.5 < stats["sparsity"] < 1 and stats["latency_s"] > 0
    pointer, _ = read_pointer(store, manifest.run, manifest.trainer_public_key)
    assert (pointer.version, pointer.anchor_version) == (4, 3)
    for v in (2, 3, 4):
        h = verify_patch_signature(store.get(layout.patch_key(manifest.run, v)), manifest.trainer_public_key)
        assert (h.base_version, h.target_version) == (v - 1, v)
    # the pointer's digest is the digest of the last published plane state
    m3, _ = read_anchor(store, manifest.run, 3, manifest.trainer_public_key)
    h3 = read_header(store.get(layout.patch_key(manifest.run, 3)))
    assert m3.state_digest == h3.result_digest
    assert verify_run(store, manifest.run, out=lambda s: None)


def test_wrong_key_is_refused(file_store):
    manifest, _key = make_run(file_store)
    with pytest.raises(ValueError, match="not the run's key"):
        Publisher(file_store, manifest, signing.generate_private_key(), anchor_interval=3)


def test_pointer_never_moves_backwards(file_store):
    manifest, key = make_run(file_store)
    pub = Publisher(file_store, manifest, key, anchor_interval=3, progress=False)
    policy = TinyPolicy()
    pub.publish_anchor(policy.state())
    policy.step()
    pub.publish(policy.state())
    old = make_pointer(manifest.run, 1, 1, "sha256:" + "0" * 64, key)
    with pytest.raises(PointerError, match="refusing to move it to v1"):
        advance_pointer(file_store, old, manifest.trainer_public_key)
    assert pub.current_version() == 2


def test_leftovers_of_a_crashed_attempt_are_skipped_never_reused(store, tmp_path):
    manifest, key = make_run(store)
    policy = TinyPolicy()
    pub = Publisher(store, manifest, key, anchor_interval=10, progress=False)
    pub.publish_anchor(policy.state())
    # A crashed attempt of the trainer itself left a shard of an anchor at v2 and a whole, signed patch at
    # v3, the pointer still at v1 (unsigned objects would be a squatter's, which the publisher takes back).
    scratch = FileStore(tmp_path / "scratch")
    other = Publisher(scratch, manifest, key, anchor_interval=10, progress=False)
    other.publish_anchor(policy.state())  # v1
    other.publish(policy.state())  # v2
    other.publish(policy.state())  # v3: the patch the crashed attempt left behind
    crashed_patch = scratch.get(layout.patch_key(manifest.run, 3))
    store.put(layout.anchor_shard_key(manifest.run, 2, 0), b"partial")
    store.put(layout.patch_key(manifest.run, 3), crashed_patch)
    policy.step()
    restarted = Publisher(store, manifest, key, anchor_interval=10, progress=False)
    assert restarted.publish_anchor(policy.state()).version == 4
    policy.step()
    assert restarted.publish(policy.state()).version == 5
    assert pub.current_version() == 5
    # the first publisher's in-memory base is stale: it must not patch from it, and not reuse a version
    policy.step()
    done = pub.publish(policy.state())
    assert done.version == 6 and done.kind == "anchor"
    assert store.get(layout.patch_key(manifest.run, 3)) == crashed_patch  # the trainer's own object, untouched


def test_int8g64_anchor_is_mlx_and_safetensors_readable(file_store, tmp_path):
    manifest, key = make_run(file_store, plane="int8g64")
    pub = Publisher(file_store, manifest, key, anchor_interval=5, progress=False)
    policy = TinyPolicy()
    pub.publish_anchor(policy.state())
    policy.step()
    pub.publish(policy.state())
    m = read_manifest(file_store, manifest.run, 1, manifest.trainer_public_key)
    names = {t.name: t for t in m.tensors}
    assert names["model.layers.0.self_attn.q_proj.weight"].dtype == "uint32"
    assert names["model.layers.0.self_attn.q_proj.scales"].dtype == "bfloat16"
    assert names["model.layers.0.self_attn.q_proj.bias"].dtype == "bfloat16"
    shard = tmp_path / "s.safetensors"
    file_store.download_file(layout.anchor_shard_key(manifest.run, 1, 0), shard)
    from safetensors.torch import load_file

    loaded = load_file(str(shard))
    assert loaded["model.layers.0.self_attn.q_proj.scales"].dtype == torch.bfloat16
    mx = pytest.importorskip("mlx.core")
    arrays = mx.load(str(shard))
    plane = get_plane("int8g64").from_hf(TinyPolicy().state())
    np.testing.assert_array_equal(np.array(arrays["model.embed_tokens.weight"]), plane["model.embed_tokens.weight"])
    _, state = read_anchor(file_store, manifest.run, 1, manifest.trainer_public_key)
    assert_same_bits(state, plane)


def test_signed_objects_name_the_run_key(file_store):
    manifest, key = make_run(file_store)
    pub = Publisher(file_store, manifest, key, anchor_interval=3, progress=False)
    pub.publish_anchor(TinyPolicy().state())
    raw = json.loads(file_store.get(layout.pointer_key(manifest.run)))
    assert raw["version"] == 1 and raw["signature"] and raw["published_at"] > 0


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_torch_encoder_publishes_the_same_bytes(tmp_path, plane):
    """The GPU path (plane made and diffed with torch on the weights' device, here the CPU) publishes
    byte-identical patches and the same anchors as the numpy path, and the bucket verifies."""
    from worker_contract.store import open_store

    key = signing.generate_private_key()
    runs = {}
    for encoder in ("numpy", "torch"):
        store = open_store(f"file://{tmp_path / encoder}")
        manifest, _ = make_run(store, plane=plane, key=key, anchor_interval=3)
        pub = Publisher(store, manifest, key, anchor_interval=3, progress=False, encoder=encoder)
        policy = TinyPolicy(seed=5)
        pub.publish_anchor(policy.state())
        for _ in range(3):
            policy.step()
            done = pub.publish(policy.state())
            assert done.stats["encoder"] == encoder and done.stats["plane_s"] >= 0
        runs[encoder] = (store, manifest)
        assert verify_run(store, manifest.run, out=lambda s: None)
    (s_np, m_np), (s_t, m_t) = runs["numpy"], runs["torch"]
    for v in (2, 3, 4):
        assert s_np.get(layout.patch_key(m_np.run, v)) == s_t.get(layout.patch_key(m_t.run, v))
    assert anchor_versions(s_np, m_np.run) == anchor_versions(s_t, m_t.run) == [1, 4]
    for v in (1, 4):
        a = read_manifest(s_np, m_np.run, v, m_np.trainer_public_key)
        b = read_manifest(s_t, m_t.run, v, m_t.trainer_public_key)
        assert a.state_digest == b.state_digest and a.tensors == b.tensors


def test_encoder_choice_is_checked(file_store):
    manifest, key = make_run(file_store)
    with pytest.raises(ValueError, match="encoder='gpu' is not known; use one of auto, numpy, torch"):
        Publisher(file_store, manifest, key, anchor_interval=3, encoder="gpu")
    pub = Publisher(file_store, manifest, key, anchor_interval=3, progress=False, encoder="torch")
    plane = get_plane("bf16").from_hf(TinyPolicy().state())
    with pytest.raises(ValueError, match="needs torch tensors"):
        pub.publish_anchor(plane)
