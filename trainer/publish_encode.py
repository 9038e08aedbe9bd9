"""From the learner's HF-named weights to what the bucket holds: the plane state, and a PULSE patch against
the last published one.

The encoder keeps the last published plane state as the base of the next patch. When the learner hands
CUDA tensors, the plane is made and diffed on the GPU (worker_contract/planes/device.py,
pulse/torch_encode.py) and the base stays there (one plane copy of GPU memory); only the patch's compact
streams and the host copies the digests need cross to the CPU. Host tensors take the numpy encoder. Both
give the same bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from worker_contract.planes import get_plane
from worker_contract.pulse import encode_patch
from worker_contract.tensors import is_torch, to_numpy, to_torch


class EncoderChoice(StrEnum):
    """Which encoder diffs the states."""

    AUTO = "auto"
    """torch on the device when the weights are CUDA tensors, numpy otherwise."""
    NUMPY = "numpy"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: str | EncoderChoice) -> EncoderChoice:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"encoder={value!r} is not known; use one of "
                             f"{', '.join(c.value for c in cls)}") from None


def drop_aliases(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop tensors that alias an earlier one (tied lm_head / embed_tokens), as HF's save does."""
    seen, out = set(), {}
    for name, t in state.items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype) if hasattr(t, "data_ptr") and t.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out[name] = t
    return out


def nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()


@dataclass
class Encoded:
    """One state encoded against the base."""

    patch: bytes
    """The unsigned patch."""
    plane_state: dict[str, Any]
    """The new plane state (numpy, or torch on the device): the next base."""
    host: dict[str, np.ndarray]
    """Host copies of the plane state made on the way (all of it for numpy; the changed tensors for torch)."""
    entries: list[dict]
    """Per-tensor digests of the new state."""
    plane_s: float
    on_device: bool


class PatchEncoder:
    """The plane of a run, and the base (last published plane state) the next patch is made against."""

    def __init__(self, plane: str, *, encoder: str | EncoderChoice = EncoderChoice.AUTO,
                 hash_threads: int | None = None):
        self.plane_name = plane
        self.plane = get_plane(plane)
        self.encoder = EncoderChoice.parse(encoder)
        #: host threads that copy the device's result to the CPU and hash it (the torch encoder)
        self.hash_threads = hash_threads or min(16, os.cpu_count() or 1)
        self.base: dict[str, Any] | None = None  # last published plane state (numpy, or torch on the device)
        self.base_entries: list[dict] | None = None
        self.base_version: int | None = None
        self.anchor_version: int | None = None

    def to_plane(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """(plane state, made on the device?): torch on the tensors' device for CUDA weights (or always with
        encoder="torch"), numpy otherwise."""
        state = drop_aliases(state)
        tensors = list(state.values())
        if self.encoder is EncoderChoice.NUMPY or not tensors or not all(is_torch(t) for t in tensors):
            if self.encoder is EncoderChoice.TORCH and tensors:
                raise ValueError("encoder='torch' needs torch tensors; got numpy arrays (use encoder='auto')")
            return self.plane.from_hf(state), False
        if self.encoder is EncoderChoice.AUTO and not any(t.device.type == "cuda" for t in tensors):
            return self.plane.from_hf(state), False
        from worker_contract.planes.device import from_hf

        return from_hf(self.plane_name, state), True

    def encode(self, state: Mapping[str, Any], version: int) -> Encoded:
        """`state` as a patch from the base (at `base_version`) to `version`."""
        assert self.base is not None, "no base to patch against: publish an anchor first"
        t0 = time.monotonic()
        plane_state, on_device = self.to_plane(state)
        plane_s = time.monotonic() - t0
        entries: list[dict] = []  # full per-tensor digests of the new state: the next base, an anchor's list
        kw = {"base_version": self.base_version, "target_version": version, "base_entries": self.base_entries,
              "entries_out": entries}
        if on_device:
            from worker_contract.pulse.torch_encode import encode_patch_torch

            first = next(iter(plane_state.values()), None)
            base = {k: v if is_torch(v) else to_torch(v).to(first.device) for k, v in self.base.items()}
            host: dict[str, np.ndarray] = {}
            patch = encode_patch_torch(base, plane_state, host_out=host, hash_threads=self.hash_threads, **kw)
            return Encoded(patch, plane_state, host, entries, plane_s, True)
        base = {k: to_numpy(v) for k, v in self.base.items()}
        return Encoded(encode_patch(base, plane_state, **kw), plane_state, plane_state, entries, plane_s, False)

    def remember(self, plane_state: dict[str, Any], entries: list[dict], version: int, *, anchor: bool) -> None:
        """`plane_state` is now published at `version`: the base of the next patch."""
        self.base, self.base_entries, self.base_version = plane_state, entries, version
        if anchor:
            self.anchor_version = version
