"""Per-tensor PULSE coding on numpy words: which positions changed, and their exact new bits.

Why this shape (measured on AdamW steps at lr 1e-6, see docs/pulse.md): an element changes when the
update crosses half an ulp, and an ulp is set by the element's exponent, which the receiver already holds.
So positions are coded with the old value's magnitude as context:

- the *candidates* S are the elements whose sign-stripped old bits are below a threshold (small weights,
  which nearly all change); their change mask is sent as a bitmap, grouped by exponent class so each run
  of bytes has one density and zstd's entropy stage codes it near its entropy;
- changes outside S (the bulk, where changes are rare) are sent as gaps between positions.

A changed value is sent as the wrapping difference of the new and old bit patterns (for floats, the
distance in ulps), zigzag-coded and split into byte planes: nearly all are +-1..+-4, so the planes above
the lowest are all zeros. Integer arithmetic on bit patterns is an exact bijection given the old bits, so
this is lossless for every dtype (+0/-0, NaN payloads); it is never a float difference.

Everything is plain numpy (no torch); the output is a list of per-family byte chunks that `format.py`
concatenates and compresses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tensors import MANTISSA_BITS

#: tensors smaller than this are coded without context (the sampling and sort are not worth it)
MIN_CONTEXT_WORDS = 1 << 14
#: the candidate set may cover at most this fraction of a tensor (it costs a pass and a sort)
MAX_CANDIDATE_FRACTION = 0.25
#: a candidate costs time (a pass, a sort, gathers); count it as this many bits when choosing the set,
#: so only classes whose changes are dense enough to pay for their bitmap join it
CANDIDATE_COST_BITS = 2.0
_SAMPLE = 1 << 16
_CHUNK = 1 << 18


class CodecError(ValueError):
    """A patch's streams do not decode into a consistent tensor."""


@dataclass
class Coded:
    """One tensor's coding: the numbers the header carries and the byte chunks per stream family."""

    unit: int
    count: int
    changed: int = 0
    threshold: int = 0
    candidates: int = 0
    changed_in: int = 0
    gap_bytes: int = 4
    chunks: dict[str, bytes] = field(default_factory=dict)


def unit_for(dtype: np.dtype) -> int:
    """Bytes per diffed word. Unsigned integers wider than a byte hold packed codes (int8g64's uint32
    words carry four 8-bit codes), so they are diffed bytewise: a code step is then one +-1 word."""
    if dtype.kind == "u" and dtype.itemsize > 1:
        return 1
    return min(dtype.itemsize, 8)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def as_units(arr: np.ndarray, unit: int) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(_UINT[unit])


def _planes(x: np.ndarray) -> list[bytes]:
    """Byte planes of an unsigned array: plane j holds byte j of every element (little-endian)."""
    w = x.dtype.itemsize
    b = x.view(np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(b[:, j]).tobytes() for j in range(w)]


def _unplanes(planes: list[bytes], n: int, w: int) -> np.ndarray:
    b = np.empty((n, w), dtype=np.uint8)
    for j, p in enumerate(planes):
        if len(p) != n:
            raise CodecError(f"byte plane {j} has {len(p)} bytes, expected {n}")
        b[:, j] = np.frombuffer(p, dtype=np.uint8)
    return b.reshape(-1).view(_UINT[w])


def _zigzag(d: np.ndarray, w: int) -> np.ndarray:
    s = d.view(_INT[w])
    return ((s << 1) ^ (s >> (8 * w - 1))).view(_UINT[w])


def _unzigzag(z: np.ndarray, w: int) -> np.ndarray:
    u = _UINT[w]
    return (z >> u(1)) ^ (np.zeros(1, u) - (z & u(1)))


def _entropy_bits(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def _magnitude(w: np.ndarray, unit: int) -> np.ndarray:
    """Sign-stripped bits (monotone in |x| for IEEE-style floats)."""
    return w & _UINT[unit]((1 << (8 * unit - 1)) - 1)


def sample_step(n: int) -> int:
    return max(1, n // _SAMPLE)


def choose_threshold(ow: np.ndarray, changed_mag: np.ndarray, mbits: int, n: int) -> int:
    """The magnitude threshold (on sign-stripped bits) that minimises the estimated coded size; 0 = none.

    Only the encoder runs this; the decoder reads the threshold from the header, so the estimate (from a
    strided sample of the old tensor) affects size, never correctness.
    """
    if n < MIN_CONTEXT_WORDS or changed_mag.size == 0:
        return 0
    sample_mag = _magnitude(ow[::sample_step(n)], ow.dtype.itemsize)
    return threshold_from(sample_mag, changed_mag, mbits, n)


def threshold_from(sample_mag: np.ndarray, changed_mag: np.ndarray, mbits: int, n: int) -> int:
    """`choose_threshold` on the small arrays it needs (the GPU encoder computes them on the device)."""
    k = changed_mag.size
    sample_cls = (sample_mag >> mbits).astype(np.int64)
    ch_cls = (changed_mag >> mbits).astype(np.int64)
    nclass = int(max(sample_cls.max(initial=0), ch_cls.max(initial=0))) + 1
    n_c = np.bincount(sample_cls, minlength=nclass) * (n / sample_cls.size)
    k_c = np.bincount(ch_cls, minlength=nclass).astype(np.float64)
    n_c = np.maximum(n_c, k_c)
    cum_n, cum_k = np.cumsum(n_c), np.cumsum(k_c)
    bitmap_bits = np.cumsum(n_c * np.maximum(_entropy_bits(k_c / np.maximum(n_c, 1)), 0.02))
    k_out = k - cum_k
    p_out = np.maximum(k_out, 1) / n
    gap_bits = k_out * _entropy_bits(p_out) / p_out
    cost = bitmap_bits + gap_bits + CANDIDATE_COST_BITS * cum_n
    cost[cum_n > MAX_CANDIDATE_FRACTION * n] = np.inf
    plain = k * _entropy_bits(np.array(k / n)) / (k / n)
    c = int(np.argmin(cost))
    if not np.isfinite(cost[c]) or cost[c] >= 0.9 * plain:
        return 0
    return (c + 1) << mbits


def _chunked_where(n: int, fill) -> np.ndarray:
    """Positions where `fill(start, stop, out)` sets True, computed a cache-sized chunk at a time so the
    scratch memory stays small (a worker may hold a large model) and no temporary of a tensor's size is
    ever allocated."""
    mask = np.empty(min(n, _CHUNK), dtype=bool)
    found = []
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        m = mask[: stop - start]
        fill(start, stop, m)
        idx = np.flatnonzero(m)
        if idx.size:
            found.append(idx + start)
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def changed_positions(ow: np.ndarray, nw: np.ndarray) -> np.ndarray:
    return _chunked_where(ow.size, lambda a, b, m: np.not_equal(ow[a:b], nw[a:b], out=m))


def _candidates(ow: np.ndarray, threshold: int, unit: int, mbits: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate positions (sign-stripped bits below the threshold) in natural order, and the stable
    order that groups them by exponent class: the bitmap is sent in that order so each class's bits sit
    together and zstd codes each run at its own density."""
    u = _UINT[unit]
    scratch = np.empty(min(ow.size, _CHUNK), dtype=u)
    keep, thr = u((1 << (8 * unit - 1)) - 1), u(threshold)

    def fill(a: int, b: int, m: np.ndarray) -> None:
        t = scratch[: b - a]
        np.bitwise_and(ow[a:b], keep, out=t)
        np.less(t, thr, out=m)

    s = _chunked_where(ow.size, fill)
    cls = (ow[s] & keep) >> u(mbits)
    cls = cls.astype(np.uint16 if int(cls.max(initial=0)) < 65536 else np.uint64)
    return s, np.argsort(cls, kind="stable")


def encode_tensor(old: np.ndarray, new: np.ndarray, dtype_name: str) -> Coded:
    """Code the difference of two tensors of the same dtype and shape."""
    unit = unit_for(old.dtype)
    ow, nw = as_units(old, unit), as_units(new, unit)
    n = ow.size
    out = Coded(unit=unit, count=n, gap_bytes=4 if n < (1 << 32) else 8)
    changed = changed_positions(ow, nw)
    k = out.changed = changed.size
    if k == 0:
        return out
    mbits = MANTISSA_BITS.get(dtype_name) if unit == old.dtype.itemsize else None
    threshold = 0
    if mbits is not None:
        threshold = choose_threshold(ow, _magnitude(ow[changed], unit), mbits, n)
    if threshold:
        cand, order = _candidates(ow, threshold, unit, mbits)
        mask = ow[cand] != nw[cand]
        k_in = int(np.count_nonzero(mask))
        pos_out = changed[_magnitude(ow[changed], unit) >= _UINT[unit](threshold)]
        out.threshold, out.candidates, out.changed_in = threshold, cand.size, k_in
        in_sorted = mask[order]
        out.chunks["bitmap"] = np.packbits(in_sorted).tobytes()
        positions = np.concatenate([cand[order[in_sorted]], pos_out])
    else:
        pos_out = positions = changed
    delta = nw[positions] - ow[positions]  # wraps: exact on the bit patterns
    return pack_streams(out, pos_out, _zigzag(delta, unit))


def pack_streams(out: Coded, pos_out: np.ndarray, zigzagged: np.ndarray) -> Coded:
    """Byte-plane split of the bulk gaps and the zigzagged deltas into `out.chunks`."""
    if pos_out.size:
        gaps = np.diff(pos_out, prepend=-1) - 1
        for j, plane in enumerate(_planes(gaps.astype(_UINT[out.gap_bytes]))):
            out.chunks[f"gap{j}"] = plane
    for j, plane in enumerate(_planes(zigzagged)):
        out.chunks[f"val{j}"] = plane
    assert out.changed_in + pos_out.size == out.changed
    return out


def decode_tensor(old: np.ndarray, coded: Coded, dtype_name: str, chunks: dict[str, bytes]) -> np.ndarray:
    """The new tensor's words (a fresh array; `old` is not touched)."""
    unit = coded.unit
    ow = as_units(old, unit)
    if ow.size != coded.count:
        raise CodecError(f"tensor has {ow.size} words of {unit} bytes, the patch expects {coded.count}")
    nw = ow.copy()
    k = coded.changed
    if k == 0:
        return nw
    parts = []
    if coded.threshold:
        mbits = MANTISSA_BITS.get(dtype_name)
        if mbits is None:
            raise CodecError(f"a magnitude threshold is not defined for dtype {dtype_name}")
        cand, order = _candidates(ow, coded.threshold, unit, mbits)
        if cand.size != coded.candidates:
            raise CodecError(f"{cand.size} candidates where the patch expects {coded.candidates}: wrong base")
        bitmap = np.frombuffer(chunks.get("bitmap", b""), dtype=np.uint8)
        if bitmap.size != (cand.size + 7) // 8:
            raise CodecError("candidate bitmap has the wrong length")
        in_sorted = np.unpackbits(bitmap, count=cand.size).view(bool)
        parts.append(cand[order[in_sorted]])
        if parts[0].size != coded.changed_in:
            raise CodecError("candidate bitmap does not match the patch's count")
    k_out = k - coded.changed_in
    if k_out:
        gw = coded.gap_bytes
        gaps = _unplanes([chunks.get(f"gap{j}", b"") for j in range(gw)], k_out, gw).astype(np.int64)
        pos_out = np.cumsum(gaps + 1) - 1
        if pos_out[-1] >= coded.count or pos_out[0] < 0:
            raise CodecError("a changed position lies outside the tensor")
        parts.append(pos_out)
    positions = np.concatenate(parts) if len(parts) > 1 else parts[0]
    z = _unplanes([chunks.get(f"val{j}", b"") for j in range(unit)], k, unit)
    nw[positions] = ow[positions] + _unzigzag(z, unit)
    return nw
