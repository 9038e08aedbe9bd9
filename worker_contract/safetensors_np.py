"""Read and write safetensors files with numpy alone (bf16 through ml_dtypes).

Written by hand because the `safetensors` package is not a dependency of the contract core, and its numpy
API has no bfloat16; the format is small and fully specified (8-byte little-endian header length, a JSON
header of {name: {dtype, shape, data_offsets}} plus optional string `__metadata__`, then the raw bytes).
Files written here load with `safetensors.torch.load_file` and `mlx.core.load`, and the tests check that.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .tensors import dtype_name, np_dtype, words

_TAGS = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "uint32": "U32",
         "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
         "float32": "F32", "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
         "float8_e5m2": "F8_E5M2"}
_NAMES = {v: k for k, v in _TAGS.items()}
_ALIGN = 8


class SafetensorsError(ValueError):
    """A file that is not valid safetensors."""


def header_for(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    head: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name in sorted(tensors):
        a = tensors[name]
        dt = dtype_name(a)
        if dt not in _TAGS:
            raise ValueError(f"tensor {name}: dtype={dt} has no safetensors tag")
        head[name] = {"dtype": _TAGS[dt], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(head, separators=(",", ":")).encode()
    return hb + b" " * (-len(hb) % _ALIGN)


def write(tensors: Mapping[str, np.ndarray], f: BinaryIO, metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors (sorted by name) to a binary file object; returns the bytes written."""
    hb = header_for(tensors, metadata)
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    n = 8 + len(hb)
    for name in sorted(tensors):
        w = words(tensors[name])
        f.write(memoryview(w).cast("B"))
        n += w.nbytes
    return n


def save_file(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: Mapping[str, str] | None = None) -> int:
    with open(path, "wb") as f:
        return write(tensors, f, metadata)


def parse_header(data: bytes | memoryview) -> tuple[dict, int]:
    """(header dict, start of the data section)."""
    if len(data) < 8:
        raise SafetensorsError("truncated safetensors file")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > 100 << 20 or 8 + hlen > len(data):
        raise SafetensorsError("truncated or malformed safetensors header")
    try:
        head = json.loads(bytes(data[8:8 + hlen]))
    except ValueError as e:
        raise SafetensorsError(f"malformed safetensors header: {e}") from None
    return head, 8 + hlen


def load(data: bytes | memoryview) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a whole file held in memory. Arrays are copies (writable, own memory)."""
    head, start = parse_header(data)
    meta = head.pop("__metadata__", {}) or {}
    body = memoryview(data)[start:]
    out = {}
    for name, info in head.items():
        tag = info.get("dtype")
        if tag not in _NAMES:
            raise SafetensorsError(f"tensor {name}: unknown safetensors dtype {tag!r}")
        dt = np_dtype(_NAMES[tag])
        a, b = info["data_offsets"]
        shape = tuple(info["shape"])
        if not 0 <= a <= b <= len(body) or b - a != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise SafetensorsError(f"tensor {name}: data offsets do not match its shape and dtype")
        out[name] = np.frombuffer(body[a:b], dtype=dt).reshape(shape).copy()
    return out, meta


def load_file(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return load(Path(path).read_bytes())
