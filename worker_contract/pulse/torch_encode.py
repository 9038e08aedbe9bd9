"""PULSE encoding with torch on the tensors' device (CUDA on the learner): the same patch bytes as the
numpy encoder, faster on a GPU.

The device does the full-size work (compare, nonzero, candidate selection, the class sort, gathers, the
zigzag deltas); only the compact streams (positions, bitmaps, deltas: about 1% of the state) travel to the
CPU, where they are split into byte planes and zstd-compressed by the shared code. The result digests need
the tensors' bytes on the CPU: they are copied and hashed on a thread pool while the device moves on.
torch is imported inside the functions, so the module itself imports in the slim contract venv.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ..tensors import MANTISSA_BITS, np_dtype, tensor_digest, to_numpy
from . import _checked, assemble, codec

if TYPE_CHECKING:
    import torch


def _int(unit: int):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[unit]


def _units(t: torch.Tensor, unit: int) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(_int(unit))


def _mag(w: torch.Tensor, unit: int) -> torch.Tensor:
    if unit == 1:
        return w & 0x7F
    return w & ((1 << (8 * unit - 1)) - 1)


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """np.packbits on the device (first element in the most significant bit)."""
    import torch

    bits = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=mask.device)
    pad = (-mask.numel()) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    return (m * bits).sum(dim=1, dtype=torch.uint8) if m.numel() else m.view(-1)


def _zigzag(d: torch.Tensor, unit: int) -> torch.Tensor:
    import torch

    if unit == 1:  # torch has no signed shift on uint8; go through int16 and back (exact mod 256)
        s = d.view(torch.int8).to(torch.int16)
        return ((s << 1) ^ (s >> 7)).to(torch.uint8)
    return (d << 1) ^ (d >> (8 * unit - 1))


def _below(x: torch.Tensor, threshold: int, unit: int) -> torch.Tensor:
    """x < threshold for non-negative x, without letting a threshold past the signed range wrap."""
    import torch

    if threshold > (1 << (8 * unit - 1)) - 1:
        return torch.ones_like(x, dtype=torch.bool)
    return x < threshold


def _np_unsigned(t: torch.Tensor, unit: int) -> np.ndarray:
    return t.cpu().numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[unit])


def _counts(cls: torch.Tensor) -> np.ndarray:
    """np.bincount of non-negative classes, counted on the device (only the histogram travels)."""
    import torch

    return torch.bincount(cls.to(torch.int64)).cpu().numpy()


def encode_tensor_torch(old: torch.Tensor, new: torch.Tensor, dtype: str) -> codec.Coded:
    import torch

    np_dt = np_dtype(dtype)
    unit = codec.unit_for(np_dt)
    ow, nw = _units(old, unit), _units(new, unit)
    n = ow.numel()
    out = codec.Coded(unit=unit, count=n, gap_bytes=4 if n < (1 << 32) else 8)
    changed = torch.nonzero(ow != nw).flatten()
    out.changed = int(changed.numel())
    if out.changed == 0:
        return out
    mbits = MANTISSA_BITS.get(dtype) if unit == np_dt.itemsize else None
    threshold = 0
    changed_mag = _mag(ow[changed], unit)
    if mbits is not None and n >= codec.MIN_CONTEXT_WORDS:
        sample = _mag(ow[:: codec.sample_step(n)], unit) >> mbits
        changed_cls = changed_mag[:: codec.changed_step(out.changed)] >> mbits
        threshold = codec.threshold_from(_counts(sample), sample.numel(), _counts(changed_cls), changed_cls.numel(),
                                         mbits, n, out.changed)
    if threshold:
        mag = _mag(ow, unit)
        cand = torch.nonzero(_below(mag, threshold, unit)).flatten()
        order = torch.sort(mag[cand] >> mbits, stable=True).indices
        mask = ow[cand] != nw[cand]
        in_sorted = mask[order]
        out.threshold, out.candidates, out.changed_in = threshold, int(cand.numel()), int(mask.sum())
        out.chunks["bitmap"] = _packbits(in_sorted).cpu().numpy().tobytes()
        pos_out = changed[~_below(changed_mag, threshold, unit)]
        positions = torch.cat([cand[order[in_sorted]], pos_out])
    else:
        pos_out = positions = changed
    zz = _zigzag(nw[positions] - ow[positions], unit)
    return _pack_streams(out, pos_out, zz)


def _pack_streams(out: codec.Coded, pos_out: torch.Tensor, zz: torch.Tensor) -> codec.Coded:
    """`codec.pack_streams` on the device: gaps and byte planes made there, then one copy to the host."""
    import torch

    k_out, k, unit, gw = pos_out.numel(), zz.numel(), out.unit, out.gap_bytes
    parts = []
    if k_out:
        gaps = torch.empty_like(pos_out)
        gaps[:1] = pos_out[:1]
        torch.sub(pos_out[1:], pos_out[:-1], out=gaps[1:])
        gaps[1:] -= 1
        parts.append(gaps.view(torch.uint8).reshape(k_out, 8)[:, :gw].t().reshape(-1))  # little-endian low bytes
    parts.append(zz.contiguous().view(torch.uint8).reshape(k, unit).t().reshape(-1))
    host = torch.cat(parts).cpu().numpy()
    for j in range(gw if k_out else 0):
        out.chunks[f"gap{j}"] = host[j * k_out:(j + 1) * k_out]
    base = gw * k_out if k_out else 0
    for j in range(unit):
        out.chunks[f"val{j}"] = host[base + j * k:base + (j + 1) * k]
    assert out.changed_in + k_out == out.changed
    return out


def _host_copy(t: torch.Tensor, producer=None) -> np.ndarray:
    """A host copy of a tensor. From CUDA: its raw bytes (one copy kernel for every dtype, packed uint32
    codes included) into pinned memory (torch's caching host allocator reuses it from one version to the
    next) on a side stream, so the copy overlaps the encoder's kernels on the main one. `producer` is the
    stream the tensor was made on (the encoder's caller's: a pool thread's own current stream is not it)."""
    import torch

    t = t.detach()
    if t.device.type != "cuda":
        return to_numpy(t.cpu())
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    try:
        side = torch.cuda.Stream(device=t.device)
        side.wait_stream(producer if producer is not None else torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(raw, non_blocking=True)
        side.synchronize()
    except RuntimeError:  # no pinned memory to be had (a locked-memory limit): a plain copy
        host = raw.cpu()
    return host.numpy().view(np_dtype(str(t.dtype).removeprefix("torch."))).reshape(tuple(t.shape))


def _host_digest(t: torch.Tensor, producer=None) -> tuple[np.ndarray, str]:
    """(host copy, digest) of a tensor, on a pool thread; BLAKE3 spreads a large tensor over the machine's
    cores (the same digest as one thread gives)."""
    arr = _host_copy(t, producer)
    return arr, tensor_digest(arr, threads=arr.nbytes >= (64 << 20))


def _current_stream(state: Mapping[str, torch.Tensor]):
    """The calling thread's current CUDA stream on the state's device (None for host tensors)."""
    import torch

    first = next(iter(state.values()), None)
    if first is None or first.device.type != "cuda":
        return None
    return torch.cuda.current_stream(first.device)


def encode_patch_torch(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                       base_version: int | None = None, target_version: int | None = None,
                       base_entries: list[dict] | None = None, entries_out: list[dict] | None = None,
                       host_out: dict[str, np.ndarray] | None = None, hash_threads: int = 8) -> bytes:
    """`encode_patch` for torch tensors on any device; the same bytes as the numpy encoder.

    `base_entries` spares hashing `old`, and then a tensor that did not change is neither copied nor hashed
    (its digest is the base's); `entries_out` receives the per-tensor records of `new` (the next base) and
    `host_out` the host copies made for the digests (numpy; an anchor uploads them).
    """
    names = _checked(old, new)
    known = {e["name"]: e["digest"] for e in base_entries} if base_entries is not None else {}
    coded, futures = {}, {}
    producer = _current_stream(new)  # the copies wait for this thread's stream, whichever it is
    with ThreadPoolExecutor(max_workers=hash_threads) as pool:
        for name in names:
            a, b = old[name], new[name]
            base = None if name in known else pool.submit(_host_digest, a, producer)
            coded[name] = encode_tensor_torch(a, b, str(a.dtype).removeprefix("torch."))
            same = coded[name].changed == 0 and name in known
            futures[name] = (None if same else pool.submit(_host_digest, b, producer), base)
        meta = {}
        for name in names:
            b = new[name]
            rs, bs = futures[name]
            base_digest = known.get(name) or bs.result()[1]
            if rs is None:
                digest = base_digest
            else:
                host, digest = rs.result()
                if host_out is not None:
                    host_out[name] = host
            meta[name] = (str(b.dtype).removeprefix("torch."), list(b.shape), base_digest, digest)
    if entries_out is not None:
        entries_out.extend({"name": k, "dtype": m[0], "shape": m[1], "digest": m[3]} for k, m in meta.items())
    return assemble(coded, meta, base_version, target_version, threads=hash_threads)
