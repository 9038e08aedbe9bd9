"""Publishes the learner's weights to the bucket: anchors, PULSE patches, and the signed pointer last.

    pub = Publisher(store, manifest, key, anchor_interval=10)
    pub.publish_anchor(hf_state)   # the base model (v1), or a fresh anchor after a resume (pointer + 1)
    pub.publish(hf_state)          # next version: a patch against the last published state, plus an
                                   # anchor every `anchor_interval` versions
Both return `PublishResult`: the version, its kind (anchor, patch, patch+anchor) and its figures.
`PatchEncoder` keeps the last published plane state as the next patch's base: on the GPU for CUDA
tensors (each plane's `from_hf_torch`, pulse/torch_encode.py), numpy on the host; the same bytes.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout, signing
from worker_contract.anchor import VersionTaken, write_anchor
from worker_contract.manifest import RunManifest
from worker_contract.planes import get_plane
from worker_contract.pulse import encode_patch, read_header, sign_patch
from worker_contract.store import PreconditionFailed, Store
from worker_contract.tensors import digest_of_entries, is_torch, state_entries, to_numpy, to_torch

from ..progress import progress as progress_bar
from .pointer import PointerWriter, PublishError, VersionClaims


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
        return self.plane.from_hf_torch(state), True

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


log = logging.getLogger(__name__)



class PublishKind(StrEnum):
    """What one publish wrote (`PublishResult.kind`, and `kind` in the version's stats object)."""

    ANCHOR = "anchor"
    """A full anchor and the pointer: the start of a chain."""
    PATCH = "patch"
    """A signed patch against the previous version, and the pointer."""
    PATCH_AND_ANCHOR = "patch+anchor"
    """A patch, and an anchor of the same version because one was due (`anchor_interval`)."""


@dataclass(frozen=True)
class PublishResult:
    """What one publish did: the version it made visible, how, and its figures."""

    version: int
    kind: PublishKind
    stats: dict[str, Any]
    """`kind`, `version`, bytes written, timings and the forgery counters (the version's stats object)."""


class Publisher:
    def __init__(self, store: Store, manifest: RunManifest, key: Ed25519PrivateKey, *, anchor_interval: int,
                 progress: bool = True, shard_bytes: int | None = None, encoder: str = "auto",
                 hash_threads: int | None = None):
        if anchor_interval < 1:
            raise ValueError(f"anchor_interval={anchor_interval} must be at least 1")
        if signing.public_key_b64(key) != manifest.trainer_public_key:
            raise ValueError(f"the signing key ({signing.fingerprint(signing.public_key_b64(key))}) is not the run's "
                             f"key ({signing.fingerprint(manifest.trainer_public_key)}); use the key run.json names")
        self.encoder = PatchEncoder(manifest.plane, encoder=encoder, hash_threads=hash_threads)
        self.store, self.manifest, self.key = store, manifest, key
        self.run, self.public_key = manifest.run, manifest.trainer_public_key
        self.anchor_interval = anchor_interval
        self.progress = progress
        self.shard_bytes = shard_bytes
        self.claims = VersionClaims(store, self.run, self.public_key)
        self.pointer = PointerWriter(store, self.run, key, self.public_key, self.claims.newest_signed)

    # -- what the counters and the base are, for callers and checks --------------------------------------
    @property
    def forged_pointer_reclaimed(self) -> int:
        """Forged `current.json` objects replaced by the signed pointer."""
        return self.pointer.forged_pointer_reclaimed

    @property
    def forged_versions_reclaimed(self) -> int:
        """Versions whose squatted objects were deleted to publish there."""
        return self.claims.forged_versions_reclaimed

    @property
    def hash_threads(self) -> int:
        return self.encoder.hash_threads

    @hash_threads.setter
    def hash_threads(self, n: int) -> None:
        self.encoder.hash_threads = n

    @property
    def _base(self) -> dict[str, Any] | None:
        """The last published plane state."""
        return self.encoder.base

    # -- reading ---------------------------------------------------------------------------------------
    def current_version(self) -> int | None:
        """The newest visible version: what the signed pointer names, never below what this publisher made
        visible. Over a pointer that does not verify (a forgery), the newest version the run key signed,
        above which the next publish reclaims the pointer. None before the first publish."""
        return self.pointer.floor() or None

    # -- writing ---------------------------------------------------------------------------------------
    def reclaim_pointer(self) -> str | None:
        """On start: a `current.json` that does not verify is rewritten to the newest version whose signed
        chain is complete (trainer/publish/pointer.py); returns the sentence saying so, None if it verified."""
        return self.pointer.reclaim()

    def publish_anchor(self, state: Mapping[str, Any]) -> PublishResult:
        """A full anchor at pointer + 1 (1 for the first), or the next free version."""
        t0 = time.monotonic()
        plane_state, on_device = self.encoder.to_plane(state)
        host = {k: to_numpy(v) for k, v in plane_state.items()} if on_device else plane_state
        entries = state_entries(host)
        version = self.claims.next_free(self.pointer.floor())
        self.claims.attempted.add(version)
        anchor_bytes = self._upload_anchor(version, host, entries)
        upload_s = time.monotonic() - t0
        self.pointer.advance(version, version, digest_of_entries(entries))
        self.encoder.remember(plane_state, entries, version, anchor=True)
        full = sum(a.nbytes for a in host.values())
        return self._done(PublishKind.ANCHOR, version, {
            "bytes": anchor_bytes, "anchor_bytes": anchor_bytes, "full_bytes": full, "upload_s": upload_s,
            "latency_s": time.monotonic() - t0})

    def publish(self, state: Mapping[str, Any]) -> PublishResult:
        """The next version: a signed patch against the last published state (plus an anchor when due); a
        full anchor instead wherever no patch can be made (no base yet, our base is not what the pointer
        names, or the version is taken: a crashed attempt or a racing writer). One fall-back, here."""
        return self._publish_patch(state) or self.publish_anchor(state)

    def _publish_patch(self, state: Mapping[str, Any]) -> PublishResult | None:
        enc, t0 = self.encoder, time.monotonic()
        version = None if enc.base_version is None else enc.base_version + 1
        if version is None or self.pointer.floor() != enc.base_version or not self.claims.claim(version):
            return None
        out = enc.encode(state, version)
        header = read_header(out.patch)
        assert header.result_digest == digest_of_entries(out.entries)
        encode_s = time.monotonic() - t0
        signed = sign_patch(out.patch, self.key)
        if not self._put_patch(version, signed):
            return None
        anchor_bytes = 0
        due = version - (enc.anchor_version or 0) >= self.anchor_interval
        if due:
            host = dict(out.host)
            host.update({k: to_numpy(v) for k, v in out.plane_state.items() if k not in host})  # unchanged tensors
            anchor_bytes = self._upload_anchor(version, host, out.entries)
        upload_s = time.monotonic() - t0 - encode_s
        self.pointer.advance(version, version if due else enc.anchor_version, header.result_digest)
        enc.remember(out.plane_state, out.entries, version, anchor=due)
        changed, words = sum(t.changed for t in header.tensors), sum(t.count for t in header.tensors)
        full = sum(nbytes(a) for a in out.plane_state.values())
        return self._done(PublishKind.PATCH_AND_ANCHOR if due else PublishKind.PATCH, version, {
            "bytes": len(signed) + anchor_bytes, "patch_bytes": len(signed), "anchor_bytes": anchor_bytes,
            "full_bytes": full, "compression": full / len(signed), "changed": changed,
            "sparsity": 1.0 - changed / max(words, 1), "encoder": "torch" if out.on_device else "numpy",
            "plane_s": out.plane_s, "encode_s": encode_s, "upload_s": upload_s, "latency_s": time.monotonic() - t0})

    def _put_patch(self, version: int, signed: bytes) -> bool:
        """Write the signed patch create-only and read it back; False when the version was taken meanwhile."""
        key = layout.patch_key(self.run, version)
        self.claims.attempted.add(version)
        try:
            etag = self.store.put_if_absent(key, signed)
        except PreconditionFailed:
            return False
        info = self.store.head(key)
        if info is None or info.size != len(signed) or info.etag.strip('"') != etag.strip('"'):
            raise PublishError(f"{key} did not land intact (read back {info})")
        return True

    def _done(self, kind: PublishKind, version: int, stats: dict[str, Any]) -> PublishResult:
        return PublishResult(version, kind, {"kind": kind, "version": version, **stats, **self._counters()})

    # -- helpers ---------------------------------------------------------------------------------------
    def _upload_anchor(self, version: int, plane_state: dict[str, np.ndarray], entries: list[dict]) -> int:
        kw = {"shard_bytes": self.shard_bytes} if self.shard_bytes else {}
        total = sum(a.nbytes for a in plane_state.values())
        done = [0]
        with progress_bar(f"anchor v{version}", total=total, unit="bytes", show=self.progress) as advance:
            def update(upto: int, _total: int) -> None:
                advance(upto - done[0])
                done[0] = upto

            try:
                m = write_anchor(self.store, self.run, version, self.manifest.plane, plane_state, self.key,
                                 entries=entries, progress=update, **kw)
            except VersionTaken as e:
                raise PublishError(f"{e}; the pointer did not move") from None
        return m.total_bytes()

    def _counters(self) -> dict[str, int]:
        return {"forged_pointer_reclaimed": self.forged_pointer_reclaimed,
                "forged_versions_reclaimed": self.forged_versions_reclaimed}
