"""Weight planes: int8g64 bit-identical to mlx.core.quantize/dequantize on the CPU (the oracle), bf16 cast."""

from __future__ import annotations

import numpy as np
import pytest

from worker_contract.planes import PLANES, bf16, get_plane, int8g64
from worker_contract.tensors import np_dtype

mx = pytest.importorskip("mlx.core", reason="mlx[cpu] is the int8g64 oracle")

MX_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.itemsize])


def _to_mx(w: np.ndarray):
    return mx.array(w.astype(np.float32)).astype(getattr(mx, MX_DTYPES[w.dtype.name]))


def _from_mx(a, dtype: str) -> np.ndarray:
    """An mlx array's exact values as numpy of `dtype` (through float32, exact for 16-bit floats)."""
    if dtype == "uint32":
        return np.array(a)
    return np.array(a.astype(mx.float32)).astype(np.float32).astype(np_dtype(dtype))


def _groups(kind: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if kind == "random":
        x = rng.normal(0, 0.02, n)
    elif kind == "zero":
        x = np.zeros(n)
    elif kind == "constant":
        x = np.repeat(rng.choice([-3.5, 0.25, 7.0, -1e-3], n // 64), 64)
    elif kind == "tiny":  # range below eps: scale clamps to 1e-7
        x = 0.5 + rng.integers(0, 3, n) * 1e-9
    elif kind == "ties":  # integer ramps put (x - bias) / scale exactly on .5 boundaries
        x = np.tile(np.arange(64) * 2.0, n // 64) + rng.integers(0, 4, n // 64).repeat(64)
    elif kind == "negative":
        x = -np.abs(rng.normal(0, 1, n)) - 0.1
    elif kind == "mixed":  # per-group scale spread over many exponents, zeros sprinkled in
        x = rng.normal(0, 1, n) * np.repeat(10.0 ** rng.uniform(-8, 3, n // 64), 64)
        x[rng.random(n) < 0.05] = 0.0
    else:
        raise AssertionError(kind)
    return x.reshape(shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kind", ["random", "zero", "constant", "tiny", "ties", "negative", "mixed"])
@pytest.mark.parametrize("shape", [(8, 256), (3, 4, 128)])
def test_quantize_matches_mlx_bit_for_bit(dtype, kind, shape):
    rng = np.random.default_rng(hash((dtype, kind, shape)) % 2**32)
    x = _groups(kind, rng, shape)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    w = x.astype(np.float32).astype(np_dtype(dtype))
    wq, scales, biases = int8g64.quantize(w)
    mq, ms, mb = mx.quantize(_to_mx(w), group_size=64, bits=8, stream=mx.cpu)
    assert wq.dtype == np.uint32 and wq.shape == (*shape[:-1], shape[-1] // 4)
    assert scales.dtype.name == dtype and scales.shape == (*shape[:-1], shape[-1] // 64)
    np.testing.assert_array_equal(wq, _from_mx(mq, "uint32"))
    np.testing.assert_array_equal(_bits(scales), _bits(_from_mx(ms, dtype)))
    np.testing.assert_array_equal(_bits(biases), _bits(_from_mx(mb, dtype)))
    dense = int8g64.dequantize(wq, scales, biases)
    md = mx.dequantize(mq, ms, mb, group_size=64, bits=8, stream=mx.cpu)
    assert dense.dtype.name == dtype
    np.testing.assert_array_equal(_bits(dense), _bits(_from_mx(md, dtype)))


def test_torch_entry_points_return_torch():
    torch = pytest.importorskip("torch")
    w = torch.randn(4, 128).to(torch.bfloat16)
    wq, s, b = int8g64.quantize(w)
    assert wq.dtype == torch.uint32 and s.dtype == torch.bfloat16 and b.dtype == torch.bfloat16
    mq, ms, mb = mx.quantize(_to_mx(w.float().numpy().astype(np_dtype("bfloat16"))), group_size=64, bits=8,
                             stream=mx.cpu)
    np.testing.assert_array_equal(wq.numpy(), np.array(mq))
    back = int8g64.dequantize(wq, s, b)
    assert back.dtype == torch.bfloat16 and back.shape == w.shape
    assert (back.float() - w.float()).abs().max() < 0.05


def test_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="divisible by 64"):
        int8g64.quantize(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="dtype=int32"):
        int8g64.quantize(np.zeros((2, 64), np.int32))


def test_registry_refuses_unknown_plane_naming_known_ones():
    assert set(PLANES) == {"bf16", "int8g64"}
    assert get_plane("int8g64") is int8g64
    with pytest.raises(ValueError, match="known: bf16, int8g64"):
        get_plane("fp8")


def _hf_state(rng):
    return {
        "model.embed_tokens.weight": rng.normal(0, 0.02, (96, 128)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.normal(0, 0.02, (128, 128)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.normal(0, 0.02, (128,)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": np.ones(128, np.float32),
        "model.layers.0.odd.weight": rng.normal(0, 0.02, (8, 100)).astype(np.float32),
        "model.layers.0.conv.weight": rng.normal(0, 0.02, (128, 1, 3)).astype(np.float32),
    }


def test_int8g64_plane_follows_mlx_lm_names_and_rule():
    state = _hf_state(np.random.default_rng(0))
    plane = int8g64.from_hf(state)
    assert plane["model.embed_tokens.weight"].dtype == np.uint32
    assert plane["model.layers.0.self_attn.q_proj.scales"].dtype.name == "bfloat16"
    assert "model.layers.0.self_attn.q_proj.biases" in plane
    for kept in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.odd.weight", "model.layers.0.conv.weight"):
        assert plane[kept].dtype.name == "bfloat16"
    for mod in ("model.layers.0.input_layernorm", "model.layers.0.odd", "model.layers.0.conv"):
        assert f"{mod}.scales" not in plane
    assert int8g64.quantized_tensors(plane) == sorted(
        f"{m}.{s}" for m in ("model.embed_tokens", "model.layers.0.self_attn.q_proj")
        for s in ("weight", "scales", "biases"))
    dense = int8g64.to_dense(plane)
    assert set(dense) == set(state)
    q = dense["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype.name == "bfloat16" and q.shape == (128, 128)
    assert np.abs(q.astype(np.float32) - state["model.layers.0.self_attn.q_proj.weight"]).max() < 1e-3


def test_bf16_plane_casts_round_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    state = _hf_state(np.random.default_rng(1))
    from_np = bf16.from_hf(state)
    from_torch = bf16.from_hf({k: torch.from_numpy(v) for k, v in state.items()})
    for k in state:
        assert from_np[k].dtype.name == "bfloat16"
        np.testing.assert_array_equal(_bits(from_np[k]), _bits(from_torch[k]))
    assert bf16.quantized_tensors(from_np) == []
    assert set(bf16.to_dense(from_np)) == set(state)


# -- the device (torch) conversion the publisher runs on the learner's GPU: the same bits, here on the CPU --
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kind", ["random", "zero", "constant", "tiny", "ties", "negative", "mixed"])
def test_device_quantize_matches_numpy_bit_for_bit(dtype, kind):
    torch = pytest.importorskip("torch")
    from worker_contract.planes.int8g64 import quantize_torch
    from worker_contract.tensors import to_numpy, to_torch

    rng = np.random.default_rng(hash(("device", dtype, kind)) % 2**32)
    x = _groups(kind, rng, (16, 256))
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    w = x.astype(np.float32).astype(np_dtype(dtype))
    want = int8g64.quantize_np(w)
    got = quantize_torch(to_torch(w))
    assert got[0].dtype == torch.uint32 and str(got[1].dtype) == f"torch.{dtype}"
    for g, e in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(to_numpy(g)), _bits(e))


@pytest.mark.parametrize("plane", sorted(PLANES))
def test_device_plane_equals_numpy_plane_and_copies(plane):
    torch = pytest.importorskip("torch")
    from worker_contract.tensors import to_numpy

    state = {k: torch.from_numpy(v) for k, v in _hf_state(np.random.default_rng(2)).items()}
    state["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)  # already bf16: must still be copied
    want = get_plane(plane).from_hf(state)
    got = get_plane(plane).from_hf_torch(state)
    assert list(got) == list(want)
    for k in want:
        assert isinstance(got[k], torch.Tensor)
        g = to_numpy(got[k])
        assert g.dtype == want[k].dtype and g.shape == want[k].shape, k
        np.testing.assert_array_equal(_bits(g), _bits(want[k]))
    state["model.norm.weight"].add_(1)  # the learner updates in place; the published plane must not move
    assert float(got["model.norm.weight"][0]) == 1.0
    with pytest.raises(ValueError, match="known: bf16, int8g64"):
        get_plane("fp8")
