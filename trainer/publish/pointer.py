"""Who holds a version in the bucket, and the signed version pointer (`current.json`), moved last.

`VersionClaims` tells the trainer's objects (signed by the run key) from a squatter's (anyone with bucket
credentials can write a key): squatters are deleted and the version is published create-only; what the
run key signed is never touched, and a version number is never reused. `PointerWriter` moves the pointer,
the only object ever overwritten, by compare-and-swap and never backwards; a `current.json` that does not
verify is a forgery, replaced above every version the run key signed (`forged_pointer_reclaimed`), at once
by a trainer that starts over one (`reclaim`). More in docs/reliability.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout
from worker_contract.anchor import AnchorError, read_manifest
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, parse_pointer, read_pointer
from worker_contract.pulse import PatchError, verify_patch_signature
from worker_contract.store import NotFound, PreconditionFailed, Store

log = logging.getLogger(__name__)

#: how many taken versions to skip before giving up (each a crashed attempt's leftovers: squatters' objects
#: are deleted, not skipped)
MAX_SKIPS = 64


class PublishError(RuntimeError):
    """Publishing failed; the pointer did not move."""


class VersionState(Enum):
    """What holds a version, to the publisher."""

    FREE = "free"
    """No object at the version."""
    OURS = "ours"
    """An object the run key signed for this version (maybe a crashed attempt's), or one this process wrote."""
    UNJUDGED = "unjudged"
    """Anchor shards with no manifest: an interrupted upload, which nothing signed tells from a squatter's."""
    FORGED = "forged"
    """Objects none of which the run key signed for this version: a squatter's."""


class VersionClaims:
    """Judges versions by their signatures and deletes squatters to claim a version."""

    def __init__(self, store: Store, run: str, public_key: str):
        self.store, self.run, self.public_key = store, run, public_key
        self.attempted: set[int] = set()  # versions this process wrote objects to: never reclaimed, even unsigned
        #: versions whose squatted objects (none signed by the run key) were deleted to publish there
        self.forged_versions_reclaimed = 0

    def judge(self, version: int) -> tuple[VersionState, list[str]]:
        """(what holds `version`, its keys)."""
        patch_key = layout.patch_key(self.run, version) if version >= 2 else None
        keys = [info.key for info in self.store.list(layout.anchor_prefix(self.run, version))]
        if patch_key is not None and self.store.head(patch_key) is not None:
            keys.append(patch_key)
        if not keys:
            return VersionState.FREE, keys
        if version in self.attempted or (patch_key in keys and self._signed_patch(version)):
            return VersionState.OURS, keys
        manifest_key = layout.anchor_manifest_key(self.run, version)
        if manifest_key in keys:
            try:
                read_manifest(self.store, self.run, version, self.public_key)
                return VersionState.OURS, keys
            except AnchorError:
                return VersionState.FORGED, keys
        shards = [k for k in keys if k.rsplit("/", 1)[-1].startswith("weights-") and k.endswith(".safetensors")]
        return (VersionState.UNJUDGED if shards else VersionState.FORGED), keys

    def _signed_patch(self, version: int) -> bool:
        try:
            header = verify_patch_signature(self.store.get(layout.patch_key(self.run, version)), self.public_key)
        except (NotFound, PatchError):
            return False
        return header.target_version == version  # not a genuine patch of another version copied here

    def claim(self, version: int) -> bool:
        """True when `version` is free to publish, after deleting a squatter's objects there."""
        state, keys = self.judge(version)
        if state is VersionState.FORGED:
            for key in keys:
                self.store.delete(key)
            self.forged_versions_reclaimed += 1
            log.warning("v%d held objects the run key did not sign (%s): written with worker credentials, not "
                        "by the trainer; deleted them to publish v%d there (%d squatted versions reclaimed)",
                        version, ", ".join(keys), version, self.forged_versions_reclaimed)
            state, _ = self.judge(version)
        return state is VersionState.FREE

    def next_free(self, after: int) -> int:
        """The first version above `after` that is free (squatters reclaimed, the trainer's leftovers skipped)."""
        v = after + 1
        for _ in range(MAX_SKIPS):
            if self.claim(v):
                return v
            v += 1
        raise PublishError(f"versions {after + 1}..{v - 1} all hold objects of earlier attempts of the trainer "
                           "(or anchor shards without a manifest); inspect the bucket")

    def newest_signed(self) -> int:
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
        return next((v for v in sorted(found, reverse=True) if self.judge(v)[0] is VersionState.OURS), 0)


class PointerWriter:
    """The pointer as this publisher sees it: what it names, and moving it to a newly published version."""

    def __init__(self, store: Store, run: str, key: Ed25519PrivateKey, public_key: str,
                 newest_signed: Callable[[], int]):
        self.store, self.run, self.key, self.public_key = store, run, key, public_key
        self._newest_signed = newest_signed
        self.visible: int | None = None  # newest version this publisher made visible
        #: forged `current.json` objects replaced by the signed pointer (each logged as a warning)
        self.forged_pointer_reclaimed = 0

    def floor(self) -> int:
        """The newest visible version: what the signed pointer names, never below what this publisher made
        visible. Over a pointer that does not verify (a forgery), the newest version the run key signed.
        0 before the first publish."""
        try:
            pointer, _ = read_pointer(self.store, self.run, self.public_key)
            floor = pointer.version if pointer else 0
        except PointerError:
            floor = self._newest_signed()  # at or above the last valid pointer, which named only such versions
        return max(floor, self.visible or 0)

    def advance(self, version: int, anchor_version: int, digest: str) -> None:
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
        self.visible = version

    # -- on start ------------------------------------------------------------------------------------
    def reclaim(self) -> str | None:
        """Over a `current.json` that does not verify, write the signed pointer to the newest version whose
        chain the run key signed end to end (anchor, then patches), by compare-and-swap on the forgery's ETag.
        Returns the sentence to tell the operator (also logged), None when the pointer verifies or is absent."""
        key = layout.pointer_key(self.run)
        try:
            raw, etag = self.store.get_with_etag(key)
            parse_pointer(raw, self.run, self.public_key)
            return None
        except NotFound:
            return None
        except PointerError as e:
            reason = str(e)
        found = self._newest_chain()
        if found is None:
            msg = (f"{key} did not verify under the run key ({reason}) and nothing signed is there to point at "
                   "yet; the first publish replaces it")
        else:
            version, anchor, digest = found
            try:
                self.store.put_if_match(key, make_pointer(self.run, version, anchor, digest, self.key).to_bytes(), etag)
            except (PreconditionFailed, NotFound):
                return self.reclaim()  # it changed under us: judge it again
            self.forged_pointer_reclaimed += 1
            self.visible = max(self.visible or 0, version)
            msg = (f"{key} did not verify under the run key ({reason}): written with worker credentials, not by the "
                   f"trainer; reclaimed it: the signed pointer names v{version} (anchor v{anchor}) again")
        log.warning("%s", msg)
        return msg

    def _newest_chain(self, tries: int = 64) -> tuple[int, int, str] | None:
        """(version, its anchor, its state digest) of the newest version reached from a complete signed anchor
        through signed patches whose digests chain; None when there is none."""
        top = self._newest_signed()
        anchors = set()
        for info in self.store.list(layout.anchors_prefix(self.run)):
            if info.key.endswith("/manifest.json"):
                try:
                    anchors.add(layout.anchor_version_of(info.key))
                except ValueError:
                    continue
        for version in range(top, max(top - tries, 0), -1):
            found = self._chain(version, anchors)
            if found is not None:
                return found
        return None

    def _chain(self, version: int, anchors: set) -> tuple[int, int, str] | None:
        headers = []  # patches from `version` down to the anchor they start from, newest first
        v, digest = version, None
        while digest is None:
            digest = self._anchor_digest(v) if v in anchors else None
            if digest is not None:
                break
            if v < 2:
                return None
            try:
                h = verify_patch_signature(self.store.get(layout.patch_key(self.run, v)), self.public_key)
            except (NotFound, PatchError):
                return None
            if h.target_version != v or h.base_version != v - 1:
                return None
            headers.append(h)
            v -= 1
        anchor = v
        for h in reversed(headers):
            if h.base_digest != digest:
                return None
            digest = h.result_digest
        return version, anchor, digest

    def _anchor_digest(self, version: int) -> str | None:
        """The state digest of a complete anchor the run key signed (every shard there, at its size)."""
        try:
            m = read_manifest(self.store, self.run, version, self.public_key)
        except AnchorError:
            return None
        for shard in m.shards:
            info = self.store.head(layout.anchor_shard_key(self.run, version, shard.index))
            if info is None or info.size != shard.size:
                return None
        return m.state_digest
