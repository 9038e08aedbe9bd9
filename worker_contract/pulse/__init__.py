"""PULSE patches: lossless sparse updates between two states of one weight plane.

    patch = encode_patch(old, new, base_version=4, target_version=5)
    new2 = apply_patch(old, patch)          # bit-identical to `new`; `old` is left as it was

Both accept numpy arrays or torch tensors (of any dtype) and return the kind they were given; the core is
numpy so a worker needs no torch. A patch names its base and target versions and the digests of its base
and result; `apply_patch` checks the base before and the result after, and raises `PatchError` (leaving the
caller's state untouched) on a wrong base, a truncated or corrupted patch, or a failed signature check.
Format: docs/pulse.md. Coding: codec.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import signing
from ..tensors import (
    DIGEST_ALG,
    blake3_hex,
    digest_of_entries,
    dtype_name,
    np_dtype,
    state_from_numpy,
    state_to_numpy,
    tensor_digest,
)
from . import codec
from .format import (
    FORMAT,
    SHORT,
    PatchError,
    PatchHeader,
    TensorPatch,
    compress_streams,
    decompress_streams,
    pack,
    pack_raw,
    signing_message,
    split,
)
from .format import check_body as _check_body


def t_lengths_match(t: TensorPatch, c: codec.Coded) -> bool:
    return t.lengths() == {f: len(x) for f, x in c.chunks.items()}


__all__ = ["FORMAT", "PatchError", "PatchHeader", "encode_patch", "apply_patch", "read_header",
           "sign_patch", "verify_patch_signature", "patch_stats"]


def _check_names(old: Mapping, new: Mapping) -> None:
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    if added or removed:
        raise PatchError(
            "a patch joins two states with the same tensor names; "
            + (f"added: {', '.join(added)}; " if added else "")
            + (f"removed: {', '.join(removed)}; " if removed else "")
            + "publish a new anchor for a change of architecture"
        )


def encode_patch(old: Mapping[str, Any], new: Mapping[str, Any], *, base_version: int | None = None,
                 target_version: int | None = None, base_entries: list[dict] | None = None,
                 entries_out: list[dict] | None = None) -> bytes:
    """The patch that turns `old` into `new` (unsigned; see `sign_patch`).

    `base_entries` (per-tensor records of `old` the caller already holds, e.g. the previous patch's result)
    spare hashing `old` again; `entries_out`, when given, receives the records of `new` (the next base).
    """
    o, _ = state_to_numpy(old)
    n, _ = state_to_numpy(new)
    coded = {name: codec.encode_tensor(o[name], n[name], dtype_name(o[name])) for name in _checked(o, n)}
    known = {e["name"]: e["digest"] for e in base_entries} if base_entries is not None else {}
    meta = {name: (dtype_name(n[name]), list(n[name].shape), known.get(name) or tensor_digest(o[name]),
                   tensor_digest(n[name])) for name in sorted(n)}
    if entries_out is not None:
        entries_out.extend({"name": k, "dtype": m[0], "shape": m[1], "digest": m[3]} for k, m in meta.items())
    return assemble(coded, meta, base_version, target_version)


def _checked(o: Mapping[str, Any], n: Mapping[str, Any]) -> list[str]:
    """Sorted names, once both states are known to hold the same names, dtypes and shapes."""
    _check_names(o, n)
    for name in sorted(n):
        a, b = o[name], n[name]
        da, db = _dt(a), _dt(b)
        if da != db or tuple(a.shape) != tuple(b.shape):
            raise PatchError(f"tensor {name}: base is {da}{list(a.shape)}, result is {db}{list(b.shape)}; "
                             "a patch cannot change a dtype or shape (publish a new anchor)")
    return sorted(n)


def _dt(x: Any) -> str:
    return dtype_name(x) if isinstance(x, np.ndarray) else str(x.dtype).removeprefix("torch.")


def assemble(coded: Mapping[str, codec.Coded], meta: Mapping[str, tuple], base_version: int | None,
             target_version: int | None, *, threads: int = 1) -> bytes:
    """Header and compressed streams from per-tensor codings; `meta[name]` = (dtype, shape, base digest,
    result digest). Shared by the numpy encoder and the torch/CUDA one (torch_encode.py); `threads`
    compresses the streams in parallel (the same bytes)."""
    families: dict[str, list[bytes]] = {}
    tensors, base_rows, result_rows = [], [], []
    for name in sorted(coded):
        c = coded[name]
        dt, shape, bdig, rdig = meta[name]
        for fam, chunk in c.chunks.items():
            families.setdefault(fam, []).append(chunk)
        tensors.append(TensorPatch(
            name=name, dtype=dt, shape=shape, changed=c.changed,
            threshold=c.threshold, candidates=c.candidates, changed_in=c.changed_in, base=bdig[:SHORT]))
        assert t_lengths_match(tensors[-1], c) and (c.unit, c.count) == (tensors[-1].unit, tensors[-1].count), name
        base_rows.append({"name": name, "dtype": dt, "shape": shape, "digest": bdig})
        result_rows.append({"name": name, "dtype": dt, "shape": shape, "digest": rdig})
    streams, body = compress_streams(families, threads=threads)
    header = PatchHeader(
        base_version=base_version, target_version=target_version, digest_alg=DIGEST_ALG,
        base_digest=digest_of_entries(base_rows), result_digest=digest_of_entries(result_rows),
        body_digest=blake3_hex(body), body_size=len(body), streams=streams, tensors=tensors)
    return pack(header, body)


def read_header(patch: bytes) -> PatchHeader:
    """The header of a patch (framing checked; body and signature not)."""
    return split(patch)[1]


def sign_patch(patch: bytes, key) -> bytes:
    """The same patch with an Ed25519 signature over its header (which pins the body by its digest)."""
    hb, _header, _sig, body = split(patch)
    return pack_raw(hb, signing.sign(key, signing_message(hb)), body)


def verify_patch_signature(patch: bytes, public_b64: str) -> PatchHeader:
    """The header, if the patch is signed by the run's key and its body matches; PatchError otherwise."""
    hb, header, sig, body = split(patch)
    try:
        signing.verify(public_b64, signing_message(hb), sig or None)
    except signing.SignatureError as e:
        raise PatchError(f"PULSE patch refused: {e}") from None
    _check_body(header, body)
    return header


def _check_base(header, o: Mapping[str, np.ndarray], verified_base_digest: str | None) -> None:
    """Refuse (PatchError) a base that is not the one the patch was made against: its names, dtypes and shapes,
    then its digest (skipped where the caller already verified `o` to have the patch's base digest)."""
    missing = sorted({t.name for t in header.tensors} - set(o))
    extra = sorted(set(o) - {t.name for t in header.tensors})
    if missing or extra:
        raise PatchError("wrong base for this patch: "
                         + (f"the base lacks {', '.join(missing)}; " if missing else "")
                         + (f"the patch does not name {', '.join(extra)}" if extra else ""))
    for t in header.tensors:
        a = o[t.name]
        if dtype_name(a) != t.dtype or list(a.shape) != t.shape:
            raise PatchError(f"wrong base for this patch: tensor {t.name} is {dtype_name(a)}{list(a.shape)}, "
                             f"the patch expects {t.dtype}{t.shape}")
    if verified_base_digest is None or verified_base_digest != header.base_digest:
        base_rows = []
        for t in header.tensors:
            dig = tensor_digest(o[t.name])
            if dig[:SHORT] != t.base:
                raise PatchError(f"wrong base for this patch (v{header.base_version} -> v{header.target_version}): "
                                 f"tensor {t.name} differs from the base it was made against")
            base_rows.append({"name": t.name, "dtype": t.dtype, "shape": t.shape, "digest": dig})
        if digest_of_entries(base_rows) != header.base_digest:
            raise PatchError(f"wrong base for this patch (v{header.base_version} -> v{header.target_version}): "
                             "its digest differs from the patch's base digest")


def apply_patch(old: Mapping[str, Any], patch: bytes, *, verified_base_digest: str | None = None,
                public_key: str | None = None, changes_out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The state the patch produces from `old`, as a new dict of new tensors.

    Refuses (PatchError) a patch for another base, a truncated or corrupted one, and (with `public_key`)
    an unsigned or forged one. `verified_base_digest`: the digest the caller already checked `old` to have
    (a follower keeps it from its last step), which spares hashing `old` again. `changes_out`, when
    given, receives for each tensor the patch changed the sorted flat element indices it changed (a packed
    word whose byte changed counts as changed): what a worker rewrites instead of reloading every tensor.
    """
    hb, header, sig, body = split(patch)
    if public_key is not None:
        verify_patch_signature(patch, public_key)
    _check_body(header, body)
    o, as_torch = state_to_numpy(old)
    _check_base(header, o, verified_base_digest)
    streams = {f: memoryview(x) for f, x in decompress_streams(header, body).items()}
    cursors = dict.fromkeys(streams, 0)
    result: dict[str, np.ndarray] = {}
    rows: list[dict] = []
    for t in header.tensors:
        chunks = {}
        for fam, ln in t.lengths().items():
            if fam not in streams or cursors[fam] + ln > len(streams[fam]):
                raise PatchError(f"corrupted PULSE patch: stream {fam} is short for tensor {t.name}")
            chunks[fam] = streams[fam][cursors[fam]:cursors[fam] + ln]
            cursors[fam] += ln
        pos: list = []
        try:
            w = codec.decode_tensor(o[t.name], _coded(t), t.dtype, chunks, positions_out=pos)
        except codec.CodecError as e:
            raise PatchError(f"tensor {t.name}: {e}") from None
        arr = w.view(np_dtype(t.dtype)).reshape(t.shape)
        if changes_out is not None and pos:
            changes_out[t.name] = np.unique(pos[0] * t.unit // arr.dtype.itemsize)
        result[t.name] = arr
        rows.append({"name": t.name, "dtype": t.dtype, "shape": t.shape, "digest": tensor_digest(arr)})
    if digest_of_entries(rows) != header.result_digest:
        raise PatchError("the patch result does not match the patch's result digest")
    return state_from_numpy(result, as_torch)


def _coded(t: TensorPatch) -> codec.Coded:
    return codec.Coded(unit=t.unit, count=t.count, changed=t.changed, threshold=t.threshold,
                       candidates=t.candidates, changed_in=t.changed_in, gap_bytes=t.gap_bytes)


def patch_stats(patch: bytes) -> dict:
    """Counts for metrics: bytes, changed words, total words, sparsity."""
    h = read_header(patch)
    changed = sum(t.changed for t in h.tensors)
    total = sum(t.count for t in h.tensors)
    return {"bytes": len(patch), "changed": changed, "words": total,
            "sparsity": 1.0 - changed / total if total else 1.0}
