"""Tensors as the contract sees them: numpy arrays with a canonical dtype name, and their digests.

Weight sync must be bit-exact for every dtype, so everything here works on bit patterns: a tensor is
flattened and viewed as unsigned words of its itemsize (bf16 -> uint16, fp32 -> uint32, bool -> uint8).
numpy has no bfloat16 of its own; `ml_dtypes` (a core dependency) supplies a real numpy dtype for it, so a
worker without torch still carries bf16 tensors with their true dtype name, and names, digests and the
safetensors dtype tags agree between the torch trainer and a numpy/MLX worker.

The torch boundary (`to_numpy`, `from_numpy_like`) imports torch only when handed a torch tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import blake3
import ml_dtypes
import numpy as np

#: canonical dtype names (torch's spelling without the prefix; numpy's `dtype.name` agrees)
_NP_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "uint16": np.dtype(np.uint16),
    "int16": np.dtype(np.int16),
    "uint32": np.dtype(np.uint32),
    "int32": np.dtype(np.int32),
    "uint64": np.dtype(np.uint64),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_WORD = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
#: float dtypes and the width of their mantissa field (bits below the exponent)
MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a canonical dtype name; ValueError naming the known ones otherwise."""
    try:
        return _NP_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not supported; known: {', '.join(sorted(_NP_DTYPES))}") from None


def round_to(x32: np.ndarray, dtype_name: str) -> np.ndarray:
    """float32 -> the storage dtype, round-to-nearest-even (NaN stays NaN)."""
    if dtype_name == "float32":
        return x32.astype(np.float32, copy=False)
    if dtype_name == "float16":
        return x32.astype(np.float16)
    u = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x32)
    if nan.any():  # keep NaN a (quiet) NaN instead of letting the carry turn it into an infinity
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded.view(np_dtype("bfloat16"))


def dtype_name(arr: np.ndarray) -> str:
    name = arr.dtype.name
    np_dtype(name)  # refuse what we cannot carry
    return name


def word_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned word a tensor's bits are handled as (complex128 -> two uint64 words an element)."""
    return _WORD[min(dtype.itemsize, 8)]


def words(arr: np.ndarray) -> np.ndarray:
    """A flat, contiguous unsigned-word view of the tensor's bits (a copy only if it is not contiguous)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return flat.view(word_dtype(arr.dtype))


def from_words(w: np.ndarray, dtype: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    dt = np_dtype(dtype) if isinstance(dtype, str) else dtype
    return w.view(dt).reshape(shape)


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bf16 and fp8 through their bit patterns) or the array itself."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    if not is_torch(x):
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")
    import torch

    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    dt = np_dtype(name)
    if name in ("bfloat16", "float16") or name.startswith("float8"):
        raw = t.view(torch.int16 if t.element_size() == 2 else torch.uint8).numpy()
        return raw.view(dt)
    return t.numpy()


def to_torch(arr: np.ndarray):
    import torch

    name = arr.dtype.name
    if name == "bfloat16" or name.startswith("float8"):
        raw = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16 if arr.itemsize == 2 else np.uint8))
        return raw.view(getattr(torch, name))
    return torch.from_numpy(np.ascontiguousarray(arr))


def state_to_numpy(state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], bool]:
    """(numpy state, whether the input was torch): entry points return the kind they were given."""
    out: dict[str, np.ndarray] = {}
    torch_in = False
    for name, x in state.items():
        torch_in = torch_in or is_torch(x)
        out[name] = to_numpy(x)
    return out, torch_in


def state_from_numpy(state: Mapping[str, np.ndarray], as_torch: bool) -> dict[str, Any]:
    return {k: to_torch(v) for k, v in state.items()} if as_torch else dict(state)


# -- digests ------------------------------------------------------------------------------------------
#: the digest algorithm of tensors, shards, patch bodies and states; named in every format that carries one
DIGEST_ALG = "blake3"


def sorted_positions(*idx: np.ndarray, size: int) -> np.ndarray:
    """The sorted distinct flat positions (int64) among `idx`, all below `size`. np.unique hashes or sorts, a
    cost that grows with the changes (seconds for a patch of tens of millions of words); marking a boolean
    array of the tensor's size and reading it back costs one pass over the tensor, whatever the changes."""
    parts = [np.asarray(i, dtype=np.int64).reshape(-1) for i in idx]
    n = sum(p.size for p in parts)
    if n * 64 < size:  # a few changes in a large tensor: sorting them is cheaper than the pass
        return np.unique(np.concatenate(parts))
    mark = np.zeros(size, dtype=bool)
    for part in parts:
        mark[part] = True
    return np.flatnonzero(mark)


def blake3_hex(data) -> str:
    """BLAKE3 (256-bit, hex) of a bytes-like object: collision-resistant like sha256 (the signed digest chain
    relies on that) and about 4x faster on one core here (AVX-512), so hashing a state costs ~0.13 s per GB."""
    return blake3.blake3(data).hexdigest()


def tensor_digest(arr: np.ndarray, *, threads: bool = False) -> str:
    """BLAKE3 (hex) of the tensor's raw little-endian bytes in C order; `threads`: spread one large tensor
    over the machine's cores (the learner's host; the digest is the same)."""
    data = memoryview(words(arr)).cast("B")
    if threads:
        return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3_hex(data)


def tensor_entry(name: str, arr: np.ndarray, digest: str | None = None) -> dict:
    """The per-tensor record that anchors and patches carry: name, dtype, shape, digest."""
    return {"name": name, "dtype": dtype_name(arr), "shape": list(arr.shape),
            "digest": digest if digest is not None else tensor_digest(arr)}


def digest_of_entries(entries: list[dict]) -> str:
    """The state digest: "blake3:" + BLAKE3 over the canonical JSON of the per-tensor records, sorted by name.

    Anchors and patches both name a state by this digest, so a state reached by a cold join from an
    anchor and one reached by patches agree exactly when their tensors do.
    """
    rows = sorted(([e["name"], e["dtype"], list(e["shape"]), e["digest"]] for e in entries), key=lambda r: r[0])
    return f"{DIGEST_ALG}:" + blake3_hex(json.dumps(rows, separators=(",", ":")).encode())


def state_entries(state: Mapping[str, np.ndarray]) -> list[dict]:
    return [tensor_entry(k, state[k]) for k in sorted(state)]


def state_digest(state: Mapping[str, Any]) -> str:
    """Digest of a whole state (numpy or torch tensors)."""
    np_state, _ = state_to_numpy(state)
    return digest_of_entries(state_entries(np_state))
