"""Publishes the learner's weights to the bucket: anchors, PULSE patches, and the signed pointer last.

    pub = Publisher(store, manifest, key, anchor_interval=10)
    pub.publish_anchor(hf_state)   # the base model (v1), or a fresh anchor after a resume (pointer + 1)
    pub.publish(hf_state)          # next version: a patch against the last published state, plus an
                                   # anchor every `anchor_interval` versions

Order, so that a crash at any instant leaves a consistent bucket: every object of a version is written
create-only and read back (size and ETag), and only then does `current.json` move, by compare-and-swap, never
backwards. A version number is never reused: if objects of version v exist from a crashed attempt, the
publisher moves on to the next free version and publishes a full anchor there (a patch to v+1 would have to
start from the crashed attempt's state, which only that attempt knew).

Anyone with bucket credentials can write any key, but only the trainer can sign (DESIGN section 7). So:
- a `current.json` that does not verify under the run key is a forgery: the next publish replaces it by
  compare-and-swap on the forged object's ETag, above every version the run key ever signed (never behind
  the last valid pointer), logs a warning and counts it (`forged_pointer_reclaimed` in `last_stats`);
- objects at a version none of which the run key signed for that version (a garbage or foreign-signed patch,
  a replayed patch of another version, a foreign-signed anchor manifest with its shards) are squatters: they
  are deleted and the version is published create-only (`forged_versions_reclaimed`). What the run key signed
  (a crashed attempt of the trainer) is never touched, and neither are anchor shards without a manifest:
  nothing signed tells an interrupted anchor upload of the trainer from a squatter's, so they are skipped.

Runs off the training critical path (the learner calls it from its own Ray actor); it keeps the last
published plane state in memory as the base of the next patch. When the learner hands CUDA tensors, the
plane is made and diffed on the GPU (worker_contract/planes/device.py, pulse/torch_encode.py) and the base
stays there (one plane copy of GPU memory); only the patch's compact streams and the host copies the
digests need cross to the CPU. Host tensors take the numpy encoder. Both give the same bytes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout, signing
from worker_contract.anchor import AnchorError, VersionTaken, read_manifest, write_anchor
from worker_contract.manifest import RunManifest
from worker_contract.planes import get_plane
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, parse_pointer, read_pointer
from worker_contract.pulse import PatchError, encode_patch, read_header, sign_patch, verify_patch_signature
from worker_contract.store import NotFound, PreconditionFailed, Store
from worker_contract.tensors import digest_of_entries, is_torch, state_entries, to_numpy, to_torch

log = logging.getLogger(__name__)

#: how many taken versions to skip before giving up (each a crashed attempt's leftovers: squatters' objects
#: are deleted, not skipped)
MAX_SKIPS = 64
#: what holds a version, to the publisher (Publisher._judge)
FREE, OURS, UNJUDGED, FORGED = "free", "ours", "unjudged", "forged"
#: which encoder diffs the states: auto = torch on the device when the weights are CUDA tensors
ENCODERS = ("auto", "numpy", "torch")


class PublishError(RuntimeError):
    """Publishing failed; the pointer did not move."""


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


class Publisher:
    def __init__(self, store: Store, manifest: RunManifest, key: Ed25519PrivateKey, *, anchor_interval: int,
                 progress: bool = True, shard_bytes: int | None = None, encoder: str = "auto",
                 hash_threads: int | None = None):
        if anchor_interval < 1:
            raise ValueError(f"anchor_interval={anchor_interval} must be at least 1")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder={encoder!r} is not known; use one of {', '.join(ENCODERS)}")
        if signing.public_key_b64(key) != manifest.trainer_public_key:
            raise ValueError(f"the signing key ({signing.fingerprint(signing.public_key_b64(key))}) is not the run's "
                             f"key ({signing.fingerprint(manifest.trainer_public_key)}); use the key run.json names")
        self.store, self.manifest, self.key = store, manifest, key
        self.run, self.public_key = manifest.run, manifest.trainer_public_key
        self.plane = get_plane(manifest.plane)
        self.anchor_interval = anchor_interval
        self.progress = progress
        self.shard_bytes = shard_bytes
        self.encoder = encoder
        #: host threads that copy the device's result to the CPU and hash it (the torch encoder)
        self.hash_threads = hash_threads or min(16, os.cpu_count() or 1)
        self._base: dict[str, Any] | None = None  # last published plane state (numpy, or torch on the device)
        self._base_entries: list[dict] | None = None
        self._base_version: int | None = None
        self._anchor_version: int | None = None
        self._visible: int | None = None  # newest version this publisher made visible
        self._attempted: set[int] = set()  # versions it wrote objects to: never reclaimed, even unsigned
        #: forged `current.json` objects replaced by the signed pointer (each logged as a warning)
        self.forged_pointer_reclaimed = 0
        #: versions whose squatted objects (none signed by the run key) were deleted to publish there
        self.forged_versions_reclaimed = 0
        self.last_stats: dict[str, Any] = {}

    # -- reading ---------------------------------------------------------------------------------------
    def current_version(self) -> int | None:
        """The newest visible version: what the signed pointer names, never below what this publisher made
        visible. Over a pointer that does not verify (a forgery), the newest version the run key signed,
        above which the next publish reclaims the pointer. None before the first publish."""
        return self._floor() or None

    def _floor(self) -> int:
        try:
            pointer, _ = read_pointer(self.store, self.run, self.public_key)
            floor = pointer.version if pointer else 0
        except PointerError:
            floor = self._newest_signed()  # at or above the last valid pointer, which named only such versions
        return max(floor, self._visible or 0)

    def _newest_signed(self) -> int:
        """The newest version holding an object the run key signed for it (0 if none)."""
        found = set()
        for info in [*self.store.list(layout.versions_prefix(self.run)),
                     *self.store.list(layout.anchors_prefix(self.run))]:
            try:
                v = layout.patch_version_of(info.key) or layout.anchor_version_of(info.key)
            except ValueError:  # a key the layout does not make: not ours
                continue
            if v is not None:
                found.add(v)
        return next((v for v in sorted(found, reverse=True) if self._judge(v)[0] == OURS), 0)

    def _judge(self, version: int) -> tuple[str, list[str]]:
        """(what holds `version`, its keys): FREE; OURS, an object the run key signed for this version (the
        trainer's, maybe from a crashed attempt) or one this publisher wrote; UNJUDGED, anchor shards with no
        manifest (an interrupted anchor upload, which nothing signed tells from a squatter's); FORGED, objects
        none of which the run key signed for this version (a squatter's)."""
        patch_key = layout.patch_key(self.run, version) if version >= 2 else None
        keys = [info.key for info in self.store.list(layout.anchor_prefix(self.run, version))]
        if patch_key is not None and self.store.head(patch_key) is not None:
            keys.append(patch_key)
        if not keys:
            return FREE, keys
        if version in self._attempted or (patch_key in keys and self._signed_patch(version)):
            return OURS, keys
        manifest_key = layout.anchor_manifest_key(self.run, version)
        if manifest_key in keys:
            try:
                read_manifest(self.store, self.run, version, self.public_key)
                return OURS, keys
            except AnchorError:
                return FORGED, keys
        shards = [k for k in keys if k.rsplit("/", 1)[-1].startswith("weights-") and k.endswith(".safetensors")]
        return (UNJUDGED if shards else FORGED), keys

    def _signed_patch(self, version: int) -> bool:
        try:
            header = verify_patch_signature(self.store.get(layout.patch_key(self.run, version)), self.public_key)
        except (NotFound, PatchError):
            return False
        return header.target_version == version  # not a genuine patch of another version copied here

    def _claim(self, version: int) -> bool:
        """True when `version` is free to publish, after deleting a squatter's objects there."""
        kind, keys = self._judge(version)
        if kind == FORGED:
            for key in keys:
                self.store.delete(key)
            self.forged_versions_reclaimed += 1
            log.warning("v%d held objects the run key did not sign (%s): written with worker credentials, not "
                        "by the trainer; deleted them to publish v%d there (%d squatted versions reclaimed)",
                        version, ", ".join(keys), version, self.forged_versions_reclaimed)
            kind, _ = self._judge(version)
        return kind == FREE

    def _next_free(self, after: int) -> int:
        v = after + 1
        for _ in range(MAX_SKIPS):
            if self._claim(v):
                return v
            v += 1
        raise PublishError(f"versions {after + 1}..{v - 1} all hold objects of earlier attempts of the trainer "
                           "(or anchor shards without a manifest); inspect the bucket")

    # -- writing ---------------------------------------------------------------------------------------
    def publish_anchor(self, state: Mapping[str, Any]) -> int:
        """A full anchor at pointer + 1 (1 for the first), or the next free version; returns the version."""
        t0 = time.monotonic()
        plane_state, on_device = self._plane(state)
        host = {k: to_numpy(v) for k, v in plane_state.items()} if on_device else plane_state
        entries = state_entries(host)
        version = self._next_free(self._floor())
        self._attempted.add(version)
        anchor_bytes = self._upload_anchor(version, host, entries)
        upload_s = time.monotonic() - t0
        self._advance(version, version, digest_of_entries(entries))
        self._remember(plane_state, entries, version, anchor=True)
        full = sum(a.nbytes for a in host.values())
        self.last_stats = {"kind": "anchor", "version": version, "bytes": anchor_bytes, "anchor_bytes": anchor_bytes,
                           "full_bytes": full, "upload_s": upload_s, "latency_s": time.monotonic() - t0,
                           **self._counters()}
        return version

    def publish(self, state: Mapping[str, Any]) -> int:
        """The next version: a signed patch against the last published state (plus an anchor when due)."""
        if self._base is None:
            return self.publish_anchor(state)
        t0 = time.monotonic()
        version = self._base_version + 1
        if self._floor() != self._base_version or not self._claim(version):
            # our base is not what the pointer names, or a crashed attempt holds the version: restart the
            # chain with a full anchor at a free version
            return self.publish_anchor(state)
        t_enc = time.monotonic()
        entries: list[dict] = []  # full per-tensor digests of the new state: the next base, an anchor's list
        patch, plane_state, host, plane_s, on_device = self._encode(state, version, entries)
        header = read_header(patch)
        assert header.result_digest == digest_of_entries(entries)
        encode_s = time.monotonic() - t_enc
        signed = sign_patch(patch, self.key)
        key = layout.patch_key(self.run, version)
        self._attempted.add(version)
        try:
            etag = self.store.put_if_absent(key, signed)
        except PreconditionFailed:
            return self.publish_anchor(state)
        info = self.store.head(key)
        if info is None or info.size != len(signed) or info.etag.strip('"') != etag.strip('"'):
            raise PublishError(f"{key} did not land intact (read back {info})")
        anchor_bytes = 0
        due = version - (self._anchor_version or 0) >= self.anchor_interval
        if due:
            host.update({k: to_numpy(v) for k, v in plane_state.items() if k not in host})  # unchanged tensors
            anchor_bytes = self._upload_anchor(version, host, entries)
        upload_s = time.monotonic() - t_enc - encode_s
        self._advance(version, version if due else self._anchor_version, header.result_digest)
        self._remember(plane_state, entries, version, anchor=due)
        changed = sum(t.changed for t in header.tensors)
        words = sum(t.count for t in header.tensors)
        full = sum(_nbytes(a) for a in plane_state.values())
        self.last_stats = {
            "kind": "patch+anchor" if due else "patch", "version": version, "bytes": len(signed) + anchor_bytes,
            "patch_bytes": len(signed), "anchor_bytes": anchor_bytes, "full_bytes": full,
            "compression": full / len(signed), "changed": changed, "sparsity": 1.0 - changed / max(words, 1),
            "encoder": "torch" if on_device else "numpy",
            "plane_s": plane_s, "encode_s": encode_s, "upload_s": upload_s, "latency_s": time.monotonic() - t0,
            **self._counters()}
        return version

    def _encode(self, state: Mapping[str, Any], version: int, entries: list[dict]):
        """(unsigned patch, plane state, its host copy, seconds making the plane, made on the device?) for
        `state` against the base: on the device with the torch encoder, or on the host with numpy."""
        t0 = time.monotonic()
        plane_state, on_device = self._plane(state)
        plane_s = time.monotonic() - t0
        kw = {"base_version": self._base_version, "target_version": version, "base_entries": self._base_entries,
              "entries_out": entries}
        if on_device:
            from worker_contract.pulse.torch_encode import encode_patch_torch

            first = next(iter(plane_state.values()), None)
            base = {k: v if is_torch(v) else to_torch(v).to(first.device) for k, v in self._base.items()}
            host: dict[str, np.ndarray] = {}
            patch = encode_patch_torch(base, plane_state, host_out=host, hash_threads=self.hash_threads, **kw)
            return patch, plane_state, host, plane_s, True
        base = {k: to_numpy(v) for k, v in self._base.items()}
        return encode_patch(base, plane_state, **kw), plane_state, plane_state, plane_s, False

    def _plane(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """(plane state, made on the device?): torch on the tensors' device for CUDA weights (or always with
        encoder="torch"), numpy otherwise."""
        state = drop_aliases(state)
        tensors = list(state.values())
        if self.encoder == "numpy" or not tensors or not all(is_torch(t) for t in tensors):
            if self.encoder == "torch" and tensors:
                raise ValueError("encoder='torch' needs torch tensors; got numpy arrays (use encoder='auto')")
            return self.plane.from_hf(state), False
        if self.encoder == "auto" and not any(t.device.type == "cuda" for t in tensors):
            return self.plane.from_hf(state), False
        from worker_contract.planes.device import from_hf

        return from_hf(self.manifest.plane, state), True

    # -- helpers ---------------------------------------------------------------------------------------
    def _upload_anchor(self, version: int, plane_state: dict[str, np.ndarray], entries: list[dict]) -> int:
        kw = {"shard_bytes": self.shard_bytes} if self.shard_bytes else {}
        total = sum(a.nbytes for a in plane_state.values())
        with _progress(self.progress, f"anchor v{version}", total) as update:
            try:
                m = write_anchor(self.store, self.run, version, self.manifest.plane, plane_state, self.key,
                                 entries=entries, progress=update, **kw)
            except VersionTaken as e:
                raise PublishError(f"{e}; the pointer did not move") from None
        return m.total_bytes()

    def _advance(self, version: int, anchor_version: int, digest: str) -> None:
        """Move the pointer to `version`: by compare-and-swap over a valid pointer (never backwards), or over
        a forged one (the caller chose `version` above every version the run key signed)."""
        new = make_pointer(self.run, version, anchor_version, digest, self.key)
        key = layout.pointer_key(self.run)
        for _ in range(8):
            try:
                advance_pointer(self.store, new, self.public_key)
                break
            except PointerError as refused:
                try:
                    raw, etag = self.store.get_with_etag(key)
                except NotFound:
                    continue  # removed meanwhile: advance_pointer creates it
                try:
                    parse_pointer(raw, self.run, self.public_key)
                except PointerError as forged:
                    reason = str(forged)
                else:
                    raise refused from None  # a valid pointer at or above `version`: never move it back
                try:
                    self.store.put_if_match(key, new.to_bytes(), etag)
                except (PreconditionFailed, NotFound):
                    continue  # it changed under us: judge it again
                self.forged_pointer_reclaimed += 1
                log.warning("%s did not verify under the run key (%s): written with worker credentials, not by "
                            "the trainer. Replaced it with the signed pointer to v%d (%d forged pointers "
                            "reclaimed); whoever wrote it holds bucket credentials", key, reason, version,
                            self.forged_pointer_reclaimed)
                break
        else:
            raise PublishError(f"{key} kept changing while writing v{version}; is another publisher running?")
        self._visible = version

    def _counters(self) -> dict[str, int]:
        return {"forged_pointer_reclaimed": self.forged_pointer_reclaimed,
                "forged_versions_reclaimed": self.forged_versions_reclaimed}

    def _remember(self, plane_state, entries, version: int, *, anchor: bool) -> None:
        self._base, self._base_entries, self._base_version = plane_state, entries, version
        if anchor:
            self._anchor_version = version


def _nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()


class _progress:
    """A rich progress bar for anchor uploads (only on a terminal: logs stay clean)."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled = enabled and sys.stderr.isatty()
        self.label, self.total = label, total

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.bar = Progress("[bold]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            transient=True)
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda done, total: self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.stop()
