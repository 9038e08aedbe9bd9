"""PULSE patches: bit-exact round trips for every dtype, and refusal of bad patches with the caller's state intact."""

from __future__ import annotations

import numpy as np
import pytest

from worker_contract import signing
from worker_contract.pulse import PatchError, apply_patch, encode_patch, patch_stats, read_header, sign_patch
from worker_contract.pulse import codec as pulse_codec
from worker_contract.tensors import np_dtype, state_digest, to_numpy, words

torch = pytest.importorskip("torch")


def _bits_equal(a, b) -> bool:
    a = a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else a
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(words(a), words(b))


def _assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        g, w = got[k], want[k]
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray), k
            assert _bits_equal(g, w), k
        else:
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape, k
            assert _bits_equal(to_numpy(g), to_numpy(w)), k


def _random_words(rng, dtype: str, shape) -> np.ndarray:
    dt = np_dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return np.frombuffer(rng.bytes(n), dtype=dt).reshape(shape).copy()


ALL_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
              "bfloat16", "float32", "float64", "complex64"]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_round_trip_random_bits_every_dtype(dtype, density):
    rng = np.random.default_rng(hash((dtype, density)) % 2**32)
    old = {"a": _random_words(rng, dtype, (37, 41)), "b": _random_words(rng, dtype, (5,)),
           "scalar": _random_words(rng, dtype, ()), "empty": _random_words(rng, dtype, (0, 3))}
    if dtype == "bool":
        old = {k: np.asarray(v.view(np.uint8) & 1).view(bool) for k, v in old.items()}
    new = {k: v.copy() for k, v in old.items()}
    for v in new.values():
        flat = v.reshape(-1)
        if flat.size == 0:
            continue
        pick = rng.random(flat.size) < density
        repl = _random_words(rng, dtype, (flat.size,)) if dtype != "bool" else ~flat
        flat[pick] = repl[pick]
    before = {k: v.copy() for k, v in old.items()}
    patch = encode_patch(old, new, base_version=1, target_version=2)
    _assert_state_equal(apply_patch(old, patch), new)
    _assert_state_equal(old, before)  # the caller's state is untouched


def test_signed_zero_and_nan_payloads_are_exact():
    old = np.array([0.0, -0.0, np.nan, 1.0, 2.0, np.inf], np.float32)
    u = old.view(np.uint32).copy()
    u[0] ^= 0x80000000            # +0 -> -0
    u[1] ^= 0x80000000            # -0 -> +0
    u[2] = 0x7FA30123             # a NaN with another payload (visible in bf16 too)
    u[3] = 0xFFC00001             # 1.0 -> negative NaN with a payload
    new = u.view(np.float32)
    for dtype, o, n in [("float32", old, new),
                        ("bfloat16", (old.view(np.uint32) >> 16).astype(np.uint16).view(np_dtype("bfloat16")),
                         (new.view(np.uint32) >> 16).astype(np.uint16).view(np_dtype("bfloat16")))]:
        patch = encode_patch({"w": o}, {"w": n})
        assert read_header(patch).tensors[0].changed == 4, dtype
        _assert_state_equal(apply_patch({"w": o}, patch), {"w": n})


def _adam_states(dtype: torch.dtype, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 128), torch.nn.Linear(128, 256), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 512))
    model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    snaps = [{k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}]
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(ids).float().reshape(-1, 512), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        snaps.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
    return snaps


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_round_trip_adam_updates_torch_in_torch_out(master):
    snaps = _adam_states(master)
    for old, new in zip(snaps, snaps[1:], strict=False):
        patch = encode_patch(old, new)
        stats = patch_stats(patch)
        assert 0.5 < stats["sparsity"] < 1.0
        got = apply_patch(old, patch)
        assert all(isinstance(v, torch.Tensor) for v in got.values())
        _assert_state_equal(got, new)
        assert read_header(patch).result_digest == state_digest(new)
    # the magnitude context is used on realistic updates
    assert any(t.threshold for t in read_header(encode_patch(snaps[0], snaps[1])).tensors)


def test_context_coding_round_trips_at_every_threshold():
    rng = np.random.default_rng(3)
    w = (rng.normal(0, 0.02, 1 << 15)).astype(np.float32)
    old = w.astype(np_dtype("bfloat16"))
    new = (w - np.sign(w) * 1e-4 * (rng.random(w.size) < 0.5)).astype(np_dtype("bfloat16"))
    ow, nw = words(old), words(new)
    for thr in (1 << 7, 100 << 7, 121 << 7, 0x7F80):
        coded = pulse_codec.Coded(unit=2, count=ow.size)
        # force a threshold through the same code path the encoder takes
        orig = pulse_codec.choose_threshold
        pulse_codec.choose_threshold = lambda *a, t=thr: t
        try:
            coded = pulse_codec.encode_tensor(old, new, "bfloat16")
        finally:
            pulse_codec.choose_threshold = orig
        assert coded.threshold == thr
        back = pulse_codec.decode_tensor(old, coded, "bfloat16", coded.chunks)
        assert np.array_equal(back, nw)


def test_unchanged_state_gives_a_tiny_patch():
    old = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    patch = encode_patch(old, {"w": old["w"].copy()})
    assert read_header(patch).tensors[0].changed == 0 and len(patch) < 2048
    _assert_state_equal(apply_patch(old, patch), old)


def test_added_or_removed_names_and_shape_changes_are_refused():
    a = {"x": np.zeros(4, np.float32), "y": np.zeros(4, np.float32)}
    with pytest.raises(PatchError, match="added: z"):
        encode_patch(a, {**a, "z": np.zeros(1, np.float32)})
    with pytest.raises(PatchError, match="removed: y"):
        encode_patch(a, {"x": a["x"]})
    with pytest.raises(PatchError, match="cannot change a dtype or shape"):
        encode_patch(a, {"x": a["x"], "y": np.zeros(5, np.float32)})
    patch = encode_patch(a, a)
    with pytest.raises(PatchError, match="wrong base.*lacks y"):
        apply_patch({"x": a["x"]}, patch)
    with pytest.raises(PatchError, match="wrong base.*does not name z"):
        apply_patch({**a, "z": a["x"]}, patch)


@pytest.fixture
def pair():
    rng = np.random.default_rng(7)
    old = {"w": rng.normal(0, 0.02, (256, 64)).astype(np_dtype("bfloat16")),
           "b": rng.normal(0, 1, 64).astype(np.float32)}
    new = {k: v.copy() for k, v in old.items()}
    words(new["w"])[::37] += 1
    words(new["b"])[::5] ^= 1
    return old, new, encode_patch(old, new, base_version=3, target_version=4)


def _refused(old, patch, match, **kw):
    before = {k: v.copy() for k, v in old.items()}
    with pytest.raises(PatchError, match=match):
        apply_patch(old, patch, **kw)
    _assert_state_equal(old, before)


def test_wrong_base_is_refused(pair):
    old, new, patch = pair
    assert read_header(patch).base_version == 3 and read_header(patch).target_version == 4
    _refused(new, patch, "wrong base")
    other = {k: v.copy() for k, v in old.items()}
    words(other["b"])[0] ^= 1
    _refused(other, patch, "wrong base.*tensor b")
    # a caller that vouches for a digest the patch does not name still gets its base checked
    _refused(other, patch, "wrong base", verified_base_digest="blake3:" + "0" * 64)


def test_truncated_and_corrupted_patches_are_refused(pair):
    old, _new, patch = pair
    for cut in (0, 5, 11, 40, len(patch) // 2, len(patch) - 1):
        _refused(old, patch[:cut], "PULSE patch")
    flipped = bytearray(patch)
    flipped[-3] ^= 0x40
    _refused(old, bytes(flipped), "corrupted")
    head = bytearray(patch)
    head[20] ^= 0x01
    _refused(old, bytes(head), "PULSE patch")
    _refused(old, b"garbage" * 10, "not a PULSE patch")
    for fmt in (1, 3):  # format 1 (sha256 digests) and a future one
        other = bytearray(patch)
        other[7] = fmt
        _refused(old, bytes(other), f"format {fmt} is not supported")


def test_signatures_refuse_forgery(pair):
    old, new, patch = pair
    key, other = signing.generate_private_key(), signing.generate_private_key()
    pub = signing.public_key_b64(key)
    signed = sign_patch(patch, key)
    _assert_state_equal(apply_patch(old, signed, public_key=pub), new)
    _refused(old, patch, "not signed", public_key=pub)
    _refused(old, sign_patch(patch, other), "does not verify", public_key=pub)
    # a re-signed header cannot carry another body: the body's digest is in the signed header
    tampered = bytearray(signed)
    tampered[-1] ^= 0xFF
    _refused(old, bytes(tampered), "corrupted", public_key=pub)


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_torch_encoder_gives_the_same_bytes(master):
    from worker_contract.pulse.torch_encode import encode_patch_torch

    snaps = _adam_states(master, steps=2)
    for old, new in zip(snaps, snaps[1:], strict=False):
        assert encode_patch_torch(old, new, base_version=1, target_version=2, hash_threads=2) == \
            encode_patch(old, new, base_version=1, target_version=2)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "uint32", "int64", "float16", "float32", "float64"])
def test_torch_encoder_every_dtype(dtype):
    from worker_contract.pulse.torch_encode import encode_patch_torch
    from worker_contract.tensors import to_torch

    rng = np.random.default_rng(11)
    old = _random_words(rng, dtype, (64, 300))
    if dtype == "bool":
        old = (old.view(np.uint8) & 1).view(bool)
    new = old.copy()
    flat = new.reshape(-1)
    pick = rng.random(flat.size) < 0.02
    flat[pick] = (~flat[pick]) if dtype == "bool" else _random_words(rng, dtype, (int(pick.sum()),))
    o, n = {"t": to_torch(old)}, {"t": to_torch(new)}
    patch = encode_patch_torch(o, n)
    assert patch == encode_patch({"t": old}, {"t": new})
    _assert_state_equal(apply_patch({"t": old}, patch), {"t": new})


def test_sorted_positions_equals_unique_on_both_paths():
    """The changed positions a worker rewrites: sorted and distinct whether they are few (sorted) or many
    (marked on the tensor), and the union of several lists is the union."""
    from worker_contract.tensors import sorted_positions

    rng = np.random.default_rng(3)
    for size, n in ((1 << 20, 50), (4096, 3000)):  # few changes in a large tensor; many in a small one
        a, b = rng.integers(0, size, n), rng.integers(0, size, n // 2)
        got = sorted_positions(a, b, size=size)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.unique(np.concatenate([a, b])))
        np.testing.assert_array_equal(sorted_positions(a, size=size), np.unique(a))
