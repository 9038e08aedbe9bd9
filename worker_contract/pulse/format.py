"""The PULSE patch container (format 2), documented in docs/pulse.md: magic, a zstd-compressed JSON
header, an optional Ed25519 signature over the header, then the body's zstd frames. The header carries the
BLAKE3 digest of the body, so a signature over the header covers the whole patch.
More in docs/pulse.md (module notes).
"""

from __future__ import annotations

import math
import struct
from typing import Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..tensors import blake3_hex, np_dtype
from .codec import unit_for

FORMAT = 2
MAGIC = b"STOAPLS" + bytes([FORMAT])
_SIG_CONTEXT = b"stoa-pulse-header\0"
MAX_HEADER_BYTES = 64 << 20
#: zstd level of the streams: level 1 is as small as 3 on these streams (measured) and faster; small streams
#: also try SMALL_ZSTD_LEVEL and keep the smaller frame (any level decodes the same)
ZSTD_LEVEL = 1
SMALL_ZSTD_LEVEL = 3
SMALL_STREAM = 4 << 20
#: the header is small and its names repeat: level 12 takes ~20% off level 3's frame in 0.3 ms (level 19: 8%
#: more, but 10 ms for 300 tensors)
HEADER_ZSTD_LEVEL = 12
#: hex digits of the per-tensor base digests a header carries (to name a tensor in an error)
SHORT = 4


class PatchError(ValueError):
    """A patch that is malformed, truncated, corrupted, unsigned/forged, or meant for another base."""


class StreamInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Stream family: gapJ / valJ (byte plane J of gaps / zigzag deltas), bitmap.")
    offset: int = Field(ge=0, description="Start of its zstd frame in the body.")
    size: int = Field(ge=0, description="Compressed bytes.")
    raw_size: int = Field(ge=0, description="Decompressed bytes (the decoder refuses more).")


class TensorPatch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Tensor name in the plane.")
    dtype: str = Field(description="Canonical dtype name (torch spelling: bfloat16, float32, uint32, bool...).")
    shape: list[int] = Field(description="Shape; equal in base and result.")
    changed: int = Field(0, ge=0, description="Words whose bits differ between base and result.")
    threshold: int = Field(0, ge=0, description="Sign-stripped-bits threshold of the candidate set; 0 = none.")
    candidates: int = Field(0, ge=0, description="Size of the candidate set (a check on the base).")
    changed_in: int = Field(0, ge=0, description="Changed words inside the candidate set.")
    base: str = Field(description="First 4 hex digits of the base tensor's digest: names a wrong tensor in an "
                      "error (the full digests are bound by base_digest, the result's by result_digest).")

    @property
    def unit(self) -> int:
        """Bytes per diffed word: the itemsize, or 1 for packed unsigned codes (codec.unit_for)."""
        return unit_for(np_dtype(self.dtype))

    @property
    def count(self) -> int:
        """Words in the tensor."""
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize // self.unit

    @property
    def gap_bytes(self) -> int:
        """Width of a gap before the byte-plane split."""
        return 4 if self.count < (1 << 32) else 8

    def lengths(self) -> dict[str, int]:
        """Bytes this tensor takes in each stream (derived, so the header does not carry them)."""
        out = {f"val{j}": self.changed for j in range(self.unit)} if self.changed else {}
        k_out = self.changed - self.changed_in
        if k_out:
            out |= {f"gap{j}": k_out for j in range(self.gap_bytes)}
        if self.threshold:
            out["bitmap"] = (self.candidates + 7) // 8
        return out


class PatchHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = Field(FORMAT, description="Container format version (also the magic's last byte).")
    digest_alg: Literal["blake3"] = Field(description="Algorithm of every digest here (tensors.DIGEST_ALG); "
                                          "always written.")
    codec: str = Field("stoa-pulse", description="Codec family name.")
    base_version: int | None = Field(None, description="Version the patch applies to.")
    target_version: int | None = Field(None, description="Version it produces.")
    base_digest: str = Field(description="State digest of the base (tensors.digest_of_entries).")
    result_digest: str = Field(description="State digest of the result.")
    body_digest: str = Field(description="BLAKE3 (hex) of the body (all stream frames).")
    body_size: int = Field(ge=0, description="Bytes of the body.")
    streams: list[StreamInfo] = Field(description="Stream frames in body order.")
    tensors: list[TensorPatch] = Field(description="Every tensor of the state, sorted by name.")


def signing_message(header_bytes: bytes) -> bytes:
    return _SIG_CONTEXT + header_bytes


def pack(header: PatchHeader, body: bytes, signature: str = "") -> bytes:
    hb = zstandard.ZstdCompressor(level=HEADER_ZSTD_LEVEL).compress(
        header.model_dump_json(exclude_defaults=True).encode())
    return pack_raw(hb, signature, body)


def pack_raw(header_bytes: bytes, signature: str, body) -> bytes:
    """Frame exact header bytes (as signed) with a signature and the body."""
    sb = signature.encode()
    return b"".join([MAGIC, struct.pack("<I", len(header_bytes)), header_bytes, struct.pack("<I", len(sb)), sb,
                     bytes(body)])


def split(patch: bytes) -> tuple[bytes, PatchHeader, str, memoryview]:
    """(header bytes, header, signature, body) of a patch; PatchError on any damage to the framing."""
    mv = memoryview(patch)
    if len(mv) < 12 or bytes(mv[:7]) != MAGIC[:7]:
        raise PatchError("not a PULSE patch (bad magic)")
    if mv[7] != FORMAT:
        raise PatchError(f"PULSE patch format {mv[7]} is not supported (this reader knows format {FORMAT})")
    (hlen,) = struct.unpack_from("<I", mv, 8)
    if hlen > MAX_HEADER_BYTES or 12 + hlen + 4 > len(mv):
        raise PatchError("truncated PULSE patch (header)")
    hb = bytes(mv[12:12 + hlen])
    (slen,) = struct.unpack_from("<I", mv, 12 + hlen)
    start = 16 + hlen + slen
    if start > len(mv):
        raise PatchError("truncated PULSE patch (signature)")
    sig = bytes(mv[16 + hlen:start]).decode("ascii", errors="replace")
    try:
        header = PatchHeader.model_validate_json(
            zstandard.ZstdDecompressor().decompress(hb, max_output_size=MAX_HEADER_BYTES))
    except zstandard.ZstdError as e:
        raise PatchError(f"corrupted PULSE patch header: {e}") from None
    except ValidationError as e:
        raise PatchError(f"corrupted PULSE patch header: {e.errors()[0]['msg']}") from None
    body = mv[start:]
    if len(body) != header.body_size:
        raise PatchError(f"truncated PULSE patch: body has {len(body)} bytes, header says {header.body_size}")
    return hb, header, sig, body


def check_body(header: PatchHeader, body: memoryview) -> None:
    if blake3_hex(body) != header.body_digest:
        raise PatchError("corrupted PULSE patch: the body's digest does not match its header")


def compress_streams(families: dict[str, list], threads: int = 1) -> tuple[list[StreamInfo], bytes]:
    """One zstd frame per stream family, in name order; `threads` > 1 compresses families in parallel (each
    frame is the same bytes either way: every family is compressed alone, single-threaded)."""
    names = sorted(families)

    def frame(name: str) -> tuple[int, bytes]:
        raw = b"".join(families[name])
        out = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
        if len(raw) < SMALL_STREAM:
            out = min(out, zstandard.ZstdCompressor(level=SMALL_ZSTD_LEVEL).compress(raw), key=len)
        return len(raw), out

    if threads > 1 and len(names) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(threads, len(names))) as pool:
            done = list(pool.map(frame, names))
    else:
        done = [frame(name) for name in names]
    infos, offset = [], 0
    for name, (raw_size, data) in zip(names, done, strict=True):
        infos.append(StreamInfo(name=name, offset=offset, size=len(data), raw_size=raw_size))
        offset += len(data)
    return infos, b"".join(data for _, data in done)


def decompress_streams(header: PatchHeader, body: memoryview) -> dict[str, bytes]:
    dctx = zstandard.ZstdDecompressor()
    out = {}
    for s in header.streams:
        frame = body[s.offset:s.offset + s.size]
        try:
            raw = dctx.decompress(frame, max_output_size=s.raw_size) if s.raw_size else b""
        except zstandard.ZstdError as e:
            raise PatchError(f"corrupted PULSE patch: stream {s.name}: {e}") from None
        if len(raw) != s.raw_size:
            raise PatchError(f"corrupted PULSE patch: stream {s.name} has {len(raw)} bytes, not {s.raw_size}")
        out[s.name] = raw
    return out
