"""Reference codecs the PULSE patch is measured against (bench only; never on the wire).

- `full_sync`: the whole state as safetensors, zstd level 1 (what a worker downloads without patches).
- `sparse_plain`: every changed position as int64 plus its raw new value, zstd level 1.
- `pulse_style`: the published PULSE codec's layout (docs/pulse.md): per tensor a 2-D view,
  changed (row, col) sorted, rows delta-coded, cols absolute at a row change else delta-coded, each stream
  in the narrowest integer type that holds it, raw new values, one buffer compressed with zstd level 1.
  Encoders return bytes; decoders rebuild the new state from the old one, so round trips are checked too.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import zstandard

from worker_contract.tensors import np_dtype, words


def _view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    rows = shape[0]
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return rows, cols


def full_sync(new: dict[str, np.ndarray]) -> bytes:
    header, blobs, off = {}, [], 0
    for name in sorted(new):
        a = new[name]
        b = words(a).tobytes()
        header[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header).encode()
    raw = struct.pack("<Q", len(hb)) + hb + b"".join(blobs)
    return zstandard.ZstdCompressor(level=1).compress(raw)


def sparse_plain_encode(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> bytes:
    parts, meta = [], []
    for name in sorted(new):
        ow, nw = words(old[name]), words(new[name])
        pos = np.flatnonzero(ow != nw).astype(np.int64)
        parts += [pos.tobytes(), nw[pos].tobytes()]
        meta.append([name, int(pos.size)])
    hb = json.dumps(meta).encode()
    return zstandard.ZstdCompressor(level=1).compress(struct.pack("<I", len(hb)) + hb + b"".join(parts))


def sparse_plain_decode(old: dict[str, np.ndarray], patch: bytes) -> dict[str, np.ndarray]:
    raw = zstandard.ZstdDecompressor().decompress(patch)
    (hl,) = struct.unpack_from("<I", raw)
    meta = json.loads(raw[4:4 + hl])
    off, out = 4 + hl, {}
    for name, k in meta:
        a = old[name]
        w = words(a).copy()
        pos = np.frombuffer(raw, np.int64, k, off)
        off += 8 * k
        w[pos] = np.frombuffer(raw, w.dtype, k, off)
        off += w.itemsize * k
        out[name] = w.view(a.dtype).reshape(a.shape)
    return out


def _narrow(x: np.ndarray, allow_u8: bool) -> np.ndarray:
    m = int(x.max(initial=0))
    if allow_u8 and m <= 255:
        return x.astype(np.uint8)
    if m <= 65535:
        return x.astype(np.uint16)
    return x.astype(np.int32)


def pulse_style_encode(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> bytes:
    entries, blobs, off = [], [], 0
    for name in sorted(new):
        a, b = old[name], new[name]
        rows, cols = _view2d(a.shape)
        ow, nw = words(a), words(b)
        flat = np.flatnonzero(ow != nw)
        if flat.size == 0:
            continue
        r, c = np.divmod(flat, max(cols, 1))  # row-major flat order is (row, col) sorted
        drow = np.diff(r, prepend=0)
        newrow = np.ones(r.size, bool)
        newrow[1:] = drow[1:] != 0
        dcol = np.where(newrow, c, c - np.concatenate([[0], c[:-1]]))
        rs, cs, vs = _narrow(drow, True), _narrow(dcol, False), nw[flat]
        entries.append({"name": name, "n": int(flat.size), "rows": rs.dtype.str, "cols": cs.dtype.str,
                        "shape": [rows, cols]})
        for x in (rs, cs, vs):
            blobs.append(x.tobytes())
            off += x.nbytes
    hb = json.dumps({"version": 31, "tensors": entries}, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=1).compress(struct.pack("<I", len(hb)) + hb + b"".join(blobs))


def pulse_style_decode(old: dict[str, np.ndarray], patch: bytes) -> dict[str, np.ndarray]:
    raw = zstandard.ZstdDecompressor().decompress(patch)
    (hl,) = struct.unpack_from("<I", raw)
    head = json.loads(raw[4:4 + hl])
    off = 4 + hl
    out = {k: v.copy() for k, v in old.items()}
    for e in head["tensors"]:
        a = old[e["name"]]
        w = words(out[e["name"]])
        n = e["n"]
        drow = np.frombuffer(raw, np.dtype(e["rows"]), n, off).astype(np.int64)
        off += drow.size * np.dtype(e["rows"]).itemsize
        dcol = np.frombuffer(raw, np.dtype(e["cols"]), n, off).astype(np.int64)
        off += dcol.size * np.dtype(e["cols"]).itemsize
        vals = np.frombuffer(raw, w.dtype, n, off)
        off += vals.nbytes
        r = np.cumsum(drow)
        seg = np.ones(n, bool)
        seg[1:] = drow[1:] != 0
        # segment-wise cumsum of cols, restarting at each row change
        cs = np.cumsum(dcol)
        starts = np.flatnonzero(seg)
        base = np.repeat(cs[starts] - dcol[starts], np.diff(np.append(starts, n)))
        c = cs - base
        w[r * e["shape"][1] + c] = vals
        out[e["name"]] = w.view(a.dtype).reshape(a.shape)
    return out


def dtype_check(name: str) -> np.dtype:
    return np_dtype(name)
