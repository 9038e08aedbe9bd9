"""Who holds a version in the bucket: the trainer (run key), a squatter, or nobody; squatters are reclaimed.

Anyone with bucket credentials can write any key, but only the trainer can sign (docs/reliability.md).
Objects at a version none of which the run key signed for that version (a garbage or foreign-signed patch,
a replayed patch of another version, a foreign-signed anchor manifest with its shards) are squatters: they
are deleted and the version is published create-only (`forged_versions_reclaimed`). What the run key
signed (a crashed attempt of the trainer) is never touched, and neither are anchor shards without a
manifest: nothing signed tells an interrupted anchor upload of the trainer from a squatter's, so such a
version is skipped. A version number is never reused.
"""

from __future__ import annotations

import logging
from enum import Enum

from worker_contract import layout
from worker_contract.anchor import AnchorError, read_manifest
from worker_contract.pulse import PatchError, verify_patch_signature
from worker_contract.store import NotFound, Store

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
