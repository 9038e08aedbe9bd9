"""Per-tensor PULSE coding on numpy words: which positions changed, and their exact new bits.

Positions are coded with the old value's magnitude as context (a bitmap for the small weights that nearly
all change, gaps between positions elsewhere); a changed value is the wrapping difference of its bit
patterns, so the coding is lossless for every dtype. Plain numpy (no torch); `format.py` concatenates and
compresses the chunks this returns.
More in docs/pulse.md (module notes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..tensors import MANTISSA_BITS, np_dtype

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


def _planes(x: np.ndarray) -> list[np.ndarray]:
    """Byte planes of an unsigned array: plane j holds byte j of every element (little-endian). One
    transposing copy; the planes are rows of it (buffers that bytes.join and zstd take as they are)."""
    w = x.dtype.itemsize
    if w == 1:
        return [x.view(np.uint8)]
    t = np.ascontiguousarray(x.view(np.uint8).reshape(-1, w).T)
    return list(t)


def _unplanes(planes: list, n: int, w: int) -> np.ndarray:
    for j, p in enumerate(planes):
        if len(p) != n:
            raise CodecError(f"byte plane {j} has {len(p)} bytes, expected {n}")
    if w == 1:
        return np.frombuffer(planes[0], dtype=np.uint8).copy()
    b = np.empty((n, w), dtype=np.uint8)
    for j, p in enumerate(planes):
        b[:, j] = np.frombuffer(p, dtype=np.uint8)
    return b.reshape(-1).view(_UINT[w])


def _zigzag(d: np.ndarray, w: int) -> np.ndarray:
    s = d.view(_INT[w])
    return ((s << 1) ^ (s >> (8 * w - 1))).view(_UINT[w])


def _unzigzag(z: np.ndarray, w: int) -> np.ndarray:
    u = _UINT[w]
    return (z >> u(1)) ^ (np.zeros(1, u) - (z & u(1)))


def _entropy_bits(p: np.ndarray) -> np.ndarray:
    p = np.minimum(np.maximum(p, 1e-12), 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def _magnitude(w: np.ndarray, unit: int) -> np.ndarray:
    """Sign-stripped bits (monotone in |x| for IEEE-style floats)."""
    return w & _UINT[unit]((1 << (8 * unit - 1)) - 1)


def class_dtype(unit: int, mbits: int) -> type:
    """The narrowest unsigned type of an exponent class (uint8 for bf16/fp16/fp32: a one-pass radix sort)."""
    return np.uint8 if 8 * unit - 1 - mbits <= 8 else np.uint16


def sample_step(n: int) -> int:
    return max(1, n // _SAMPLE)


def choose_threshold(ow: np.ndarray, changed_old: np.ndarray, mbits: int, n: int) -> int:
    """The magnitude threshold (on sign-stripped bits) that minimises the estimated coded size; 0 = none.

    Only the encoder runs this; the decoder reads the threshold from the header, so the estimate (from
    strided samples of the old tensor and of the changed words' old values) affects size, never correctness.
    """
    if n < MIN_CONTEXT_WORDS or changed_old.size == 0:
        return 0
    unit, k = ow.dtype.itemsize, changed_old.size
    sample = _magnitude(ow[::sample_step(n)], unit) >> _UINT[unit](mbits)
    changed = _magnitude(changed_old[::changed_step(k)], unit) >> _UINT[unit](mbits)
    return threshold_from(_bincount(sample), sample.size, _bincount(changed), changed.size, mbits, n, k)


def changed_step(k: int) -> int:
    """Stride of the changed words whose classes are counted (2^18 of them: as exact as all, measured)."""
    return max(1, k >> 18)


def _bincount(cls: np.ndarray) -> np.ndarray:
    return np.bincount(cls if cls.dtype.itemsize < 8 else cls.astype(np.intp))


def threshold_from(sample_counts: np.ndarray, sample_size: int, changed_counts: np.ndarray, changed_size: int,
                   mbits: int, n: int, k: int) -> int:
    """`choose_threshold` from class histograms (exponent class = sign-stripped bits >> mbits) of the strided
    samples of the old tensor (n words) and of the k changed words' old values; the GPU encoder counts on
    the device and passes the same numbers, so both encoders choose the same threshold."""
    nclass = max(sample_counts.size, changed_counts.size)
    n_c = np.zeros(nclass)
    n_c[: sample_counts.size] = sample_counts * (n / sample_size)
    k_c = np.zeros(nclass)
    k_c[: changed_counts.size] = changed_counts * (k / changed_size)
    n_c = np.maximum(n_c, k_c)
    cum_n, cum_k = np.cumsum(n_c), np.cumsum(k_c)
    bitmap_bits = np.cumsum(n_c * np.maximum(_entropy_bits(k_c / np.maximum(n_c, 1)), 0.02))
    k_out = np.maximum(k - cum_k, 0)
    p_out = np.maximum(k_out, 1) / n
    gap_bits = k_out * _entropy_bits(p_out) / p_out
    cost = bitmap_bits + gap_bits + CANDIDATE_COST_BITS * cum_n
    cost[cum_n > MAX_CANDIDATE_FRACTION * n] = np.inf
    plain = k * _entropy_bits(np.array(k / n)) / (k / n)
    c = int(np.argmin(cost))
    if not np.isfinite(cost[c]) or cost[c] >= 0.9 * plain:
        return 0
    return (c + 1) << mbits


def _group_hits(blocks: int, unit: int, fill: Callable[[int, int, np.ndarray], None]) -> Iterator[np.ndarray]:
    """Indices of the 8-word groups (`unit` uint64 blocks each) with a block that `fill(a, b, out)` marks
    True, a chunk of blocks at a time.

    Why groups of 8 words: numpy's nonzero is the costly pass, and below 10% density it takes a branchy
    loop that mispredicts. Testing 8 bytes at a time (uint64 blocks) and then 8 words at a time (a group's
    block flags viewed as one integer) leaves a quarter to a sixteenth of the elements for nonzero, and
    within a hit group at least 1 word in 8 is a hit, so the second nonzero stays on the branchless path.
    """
    mask = np.empty(min(blocks, _CHUNK), dtype=bool)
    gmask = np.empty(min(blocks, _CHUNK) // unit, dtype=bool)
    for a in range(0, blocks, _CHUNK):
        b = min(blocks, a + _CHUNK)
        m = mask[: b - a]
        fill(a, b, m)
        if unit > 1:
            g = gmask[: (b - a) // unit]
            np.not_equal(m.view(_UINT[unit]), 0, out=g)
            m = g
        idx = np.flatnonzero(m)
        if idx.size:
            idx += a // unit
            yield idx


def _lane_positions(groups: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Word positions of lane hits `j` (flat indices into the gathered (groups, 8) rows)."""
    pos = np.take(groups, j >> 3)
    pos <<= 3
    pos |= j & 7
    return pos


def diff_words(ow: np.ndarray, nw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old words, new words) of the words whose bits differ, positions ascending; the words
    are compared 8 bytes, then 8 words at a time (`_group_hits`), and only hit groups word by word."""
    unit, n = ow.dtype.itemsize, ow.size
    ng = n // 8
    pos, olds, news = [], [], []
    if ng:
        o2, n2 = ow[: ng * 8].reshape(-1, 8), nw[: ng * 8].reshape(-1, 8)
        ob, nb = o2.reshape(-1).view(np.uint64), n2.reshape(-1).view(np.uint64)
        for grp in _group_hits(ob.size, unit, lambda a, b, m: np.not_equal(ob[a:b], nb[a:b], out=m)):
            ro, rn = np.take(o2, grp, axis=0).reshape(-1), np.take(n2, grp, axis=0).reshape(-1)
            j = np.flatnonzero(ro != rn)
            pos.append(_lane_positions(grp, j))
            olds.append(ro[j])
            news.append(rn[j])
    if ng * 8 < n:  # the last words that do not fill a group
        t = ng * 8
        j = np.flatnonzero(ow[t:] != nw[t:])
        pos.append(j + t)
        olds.append(ow[t:][j])
        news.append(nw[t:][j])
    if not pos:
        return np.zeros(0, np.int64), ow[:0], nw[:0]
    if len(pos) == 1:
        return pos[0], olds[0], news[0]
    return np.concatenate(pos), np.concatenate(olds), np.concatenate(news)


def _candidate_scan(ow: np.ndarray, threshold: int, unit: int, mbits: int, *, nw: np.ndarray | None = None,
                    copy_to: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The candidates (sign-stripped bits below the threshold): their positions, their exponent classes and,
    with `nw`, whether each changed. `copy_to` receives a copy of `ow` in the same pass (the decoder's fresh
    result array), so the tensor is read once.

    Blocks and groups as in `diff_words`. A uint64 block holds a candidate when some lane y (sign-stripped)
    is below t: with each lane's top bit set first, (y | top) - t never borrows across lanes and keeps the
    top bit exactly when y >= t (SWAR arithmetic).
    """
    u, cdt = _UINT[unit], class_dtype(unit, mbits)
    n, top = ow.size, 1 << (8 * unit - 1)
    keep, sh = u(top - 1), u(mbits)
    if threshold >= top:  # every word is a candidate
        if copy_to is not None:
            copy_to[:] = ow
        return (np.arange(n), ((ow & keep) >> sh).astype(cdt), (ow != nw) if nw is not None else None)
    per = 8 // unit
    hi = np.uint64(sum(top << (8 * unit * i) for i in range(per)))
    lo = np.uint64(sum(threshold << (8 * unit * i) for i in range(per)))
    ng = n // 8
    o2 = ow[: ng * 8].reshape(-1, 8)
    ob = o2.reshape(-1).view(np.uint64)
    n2 = nw[: ng * 8].reshape(-1, 8) if nw is not None else None
    cb = copy_to[: ng * 8].view(np.uint64) if copy_to is not None else None
    scratch = np.empty(min(ob.size, _CHUNK), dtype=np.uint64)
    pos, cls, ne = [], [], []

    def fill(a: int, b: int, m: np.ndarray) -> None:
        t = scratch[: b - a]
        if cb is not None:
            cb[a:b] = ob[a:b]
        np.bitwise_or(ob[a:b], hi, out=t)
        np.subtract(t, lo, out=t)
        np.bitwise_and(t, hi, out=t)
        np.not_equal(t, hi, out=m)

    for grp in _group_hits(ob.size, unit, fill) if ng else ():
        words = np.take(o2, grp, axis=0).reshape(-1)
        mag = words & keep
        j = np.flatnonzero(mag < u(threshold))
        pos.append(_lane_positions(grp, j))
        cls.append((mag[j] >> sh).astype(cdt))
        if n2 is not None:
            ne.append(words[j] != np.take(n2, grp, axis=0).reshape(-1)[j])
    t = ng * 8
    if t < n:  # the last words that do not fill a group
        if copy_to is not None:
            copy_to[t:] = ow[t:]
        mag = ow[t:] & keep
        j = np.flatnonzero(mag < u(threshold))
        pos.append(j + t)
        cls.append((mag[j] >> sh).astype(cdt))
        if nw is not None:
            ne.append(ow[t:][j] != nw[t:][j])
    if not pos:
        return np.zeros(0, np.int64), np.zeros(0, cdt), (np.zeros(0, bool) if nw is not None else None)
    cat = np.concatenate
    return cat(pos), cat(cls), (cat(ne) if nw is not None else None)


def encode_tensor(old: np.ndarray, new: np.ndarray, dtype_name: str) -> Coded:
    """Code the difference of two tensors of the same dtype and shape."""
    unit = unit_for(old.dtype)
    ow, nw = as_units(old, unit), as_units(new, unit)
    n = ow.size
    out = Coded(unit=unit, count=n, gap_bytes=4 if n < (1 << 32) else 8)
    positions, ov, nv = diff_words(ow, nw)
    out.changed = positions.size
    if out.changed == 0:
        return out
    zz = _zigzag(nv - ov, unit)  # wraps: exact on the bit patterns
    mbits = MANTISSA_BITS.get(dtype_name) if unit == old.dtype.itemsize else None
    threshold = choose_threshold(ow, ov, mbits, n) if mbits is not None else 0
    if not threshold:
        return pack_streams(out, positions, zz)
    cand, cls, ne = _candidate_scan(ow, threshold, unit, mbits, nw=nw)
    in_sorted = ne[np.argsort(cls, kind="stable")]
    inside = _magnitude(ov, unit) < _UINT[unit](min(threshold, (1 << (8 * unit)) - 1))
    out.threshold, out.candidates, out.changed_in = threshold, cand.size, int(np.count_nonzero(inside))
    assert int(np.count_nonzero(in_sorted)) == out.changed_in
    out.chunks["bitmap"] = np.packbits(in_sorted)
    # the changed candidates in bitmap order (class, then position): a stable sort of their classes
    zin = zz[inside]
    order = np.argsort((_magnitude(ov[inside], unit) >> _UINT[unit](mbits)).astype(class_dtype(unit, mbits)),
                       kind="stable")
    outside = ~inside
    return pack_streams(out, positions[outside], np.concatenate([zin[order], zz[outside]]))


def pack_streams(out: Coded, pos_out: np.ndarray, zigzagged: np.ndarray) -> Coded:
    """Byte-plane split of the bulk gaps and the zigzagged deltas into `out.chunks`."""
    if pos_out.size:
        gw = _UINT[out.gap_bytes]
        p = pos_out.astype(gw)
        gaps = np.empty_like(p)
        gaps[0] = p[0]
        np.subtract(p[1:], p[:-1], out=gaps[1:])
        gaps[1:] -= gw(1)
        for j, plane in enumerate(_planes(gaps)):
            out.chunks[f"gap{j}"] = plane
    for j, plane in enumerate(_planes(zigzagged)):
        out.chunks[f"val{j}"] = plane
    assert out.changed_in + pos_out.size == out.changed
    return out


def decode_tensor(old: np.ndarray, coded: Coded, dtype_name: str, chunks: dict,
                  positions_out: list | None = None) -> np.ndarray:
    """The new tensor's words (a fresh array; `old` is not touched); `positions_out` receives the changed
    word positions (int64, unsorted) when given."""
    unit = coded.unit
    ow = as_units(old, unit)
    if ow.size != coded.count:
        raise CodecError(f"tensor has {ow.size} words of {unit} bytes, the patch expects {coded.count}")
    k = coded.changed
    if k == 0:
        return ow.copy()
    parts = []
    if coded.threshold:
        mbits = MANTISSA_BITS.get(dtype_name) if unit == np_dtype(dtype_name).itemsize else None
        if mbits is None:
            raise CodecError(f"a magnitude threshold is not defined for dtype {dtype_name}")
        nw = np.empty_like(ow)
        cand, cls, _ = _candidate_scan(ow, coded.threshold, unit, mbits, copy_to=nw)
        if cand.size != coded.candidates:
            raise CodecError(f"{cand.size} candidates where the patch expects {coded.candidates}: wrong base")
        bitmap = np.frombuffer(chunks.get("bitmap", b""), dtype=np.uint8)
        if bitmap.size != (cand.size + 7) // 8:
            raise CodecError("candidate bitmap has the wrong length")
        in_sorted = np.unpackbits(bitmap, count=cand.size).view(bool)
        parts.append(cand[np.argsort(cls, kind="stable")[in_sorted]])
        if parts[0].size != coded.changed_in:
            raise CodecError("candidate bitmap does not match the patch's count")
    else:
        nw = ow.copy()
    k_out = k - coded.changed_in
    if k_out:
        gw = coded.gap_bytes
        gaps = _unplanes([chunks.get(f"gap{j}", b"") for j in range(gw)], k_out, gw)
        if int(gaps.max()) >= coded.count:
            raise CodecError("a changed position lies outside the tensor")
        pos_out = np.cumsum(gaps, dtype=np.int64)
        pos_out += np.arange(k_out, dtype=np.int64)
        if pos_out[-1] >= coded.count:
            raise CodecError("a changed position lies outside the tensor")
        parts.append(pos_out)
    positions = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if positions_out is not None:
        positions_out.append(positions)
    z = _unplanes([chunks.get(f"val{j}", b"") for j in range(unit)], k, unit)
    nw[positions] += _unzigzag(z, unit)
    return nw
