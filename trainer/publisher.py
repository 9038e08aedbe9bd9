"""Publishes the learner's weights to the bucket: anchors, PULSE patches, and the signed pointer last.

    pub = Publisher(store, manifest, key, anchor_interval=10)
    pub.publish_anchor(hf_state)   # the base model (v1), or a fresh anchor after a resume (pointer + 1)
    pub.publish(hf_state)          # next version: a patch against the last published state, plus an
                                   # anchor every `anchor_interval` versions
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout, signing
from worker_contract.anchor import VersionTaken, write_anchor
from worker_contract.manifest import RunManifest
from worker_contract.pulse import read_header, sign_patch
from worker_contract.store import PreconditionFailed, Store
from worker_contract.tensors import digest_of_entries, state_entries, to_numpy

from .progress import progress as progress_bar
from .publish_claims import MAX_SKIPS, PublishError, VersionClaims, VersionState
from .publish_encode import EncoderChoice, PatchEncoder, drop_aliases, nbytes
from .publish_pointer import PointerWriter

log = logging.getLogger(__name__)

__all__ = ["MAX_SKIPS", "EncoderChoice", "PublishError", "PublishKind", "Publisher", "VersionState", "drop_aliases"]


class PublishKind(StrEnum):
    """What one publish wrote (`kind` in `last_stats` and in the version's stats object)."""

    ANCHOR = "anchor"
    """A full anchor and the pointer: the start of a chain."""
    PATCH = "patch"
    """A signed patch against the previous version, and the pointer."""
    PATCH_AND_ANCHOR = "patch+anchor"
    """A patch, and an anchor of the same version because one was due (`anchor_interval`)."""


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
        self.last_stats: dict[str, Any] = {}

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
        chain is complete (trainer/publish_pointer.py); returns the sentence saying so, None if it verified."""
        return self.pointer.reclaim()

    def publish_anchor(self, state: Mapping[str, Any]) -> int:
        """A full anchor at pointer + 1 (1 for the first), or the next free version; returns the version."""
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
        self.last_stats = {"kind": PublishKind.ANCHOR, "version": version, "bytes": anchor_bytes, "anchor_bytes": anchor_bytes,
                           "full_bytes": full, "upload_s": upload_s, "latency_s": time.monotonic() - t0,
                           **self._counters()}
        return version

    def publish(self, state: Mapping[str, Any]) -> int:
        """The next version: a signed patch against the last published state (plus an anchor when due)."""
        enc = self.encoder
        if enc.base is None:
            return self.publish_anchor(state)
        t0 = time.monotonic()
        version = enc.base_version + 1
        if self.pointer.floor() != enc.base_version or not self.claims.claim(version):
            # our base is not what the pointer names, or a crashed attempt holds the version: restart the
            # chain with a full anchor at a free version
            return self.publish_anchor(state)
        t_enc = time.monotonic()
        out = enc.encode(state, version)
        header = read_header(out.patch)
        assert header.result_digest == digest_of_entries(out.entries)
        encode_s = time.monotonic() - t_enc
        signed = sign_patch(out.patch, self.key)
        key = layout.patch_key(self.run, version)
        self.claims.attempted.add(version)
        try:
            etag = self.store.put_if_absent(key, signed)
        except PreconditionFailed:
            return self.publish_anchor(state)
        info = self.store.head(key)
        if info is None or info.size != len(signed) or info.etag.strip('"') != etag.strip('"'):
            raise PublishError(f"{key} did not land intact (read back {info})")
        anchor_bytes = 0
        due = version - (enc.anchor_version or 0) >= self.anchor_interval
        if due:
            host = dict(out.host)
            host.update({k: to_numpy(v) for k, v in out.plane_state.items() if k not in host})  # unchanged tensors
            anchor_bytes = self._upload_anchor(version, host, out.entries)
        upload_s = time.monotonic() - t_enc - encode_s
        self.pointer.advance(version, version if due else enc.anchor_version, header.result_digest)
        enc.remember(out.plane_state, out.entries, version, anchor=due)
        changed = sum(t.changed for t in header.tensors)
        words = sum(t.count for t in header.tensors)
        full = sum(nbytes(a) for a in out.plane_state.values())
        self.last_stats = {
            "kind": PublishKind.PATCH_AND_ANCHOR if due else PublishKind.PATCH, "version": version, "bytes": len(signed) + anchor_bytes,
            "patch_bytes": len(signed), "anchor_bytes": anchor_bytes, "full_bytes": full,
            "compression": full / len(signed), "changed": changed, "sparsity": 1.0 - changed / max(words, 1),
            "encoder": "torch" if out.on_device else "numpy",
            "plane_s": out.plane_s, "encode_s": encode_s, "upload_s": upload_s, "latency_s": time.monotonic() - t0,
            **self._counters()}
        return version

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
