"""The signed version pointer (`current.json`): read it, and move it last, never backwards.

The pointer is the only object of a run that is ever overwritten, by compare-and-swap. A `current.json`
that does not verify under the run key is a forgery (written with worker credentials): the next publish
replaces it by compare-and-swap on the forged object's ETag, above every version the run key ever signed
(never behind the last valid pointer), logs a warning and counts it (`forged_pointer_reclaimed`). A trainer
that starts over a forgery reclaims it at once (`reclaim`): the pointer goes to the newest version whose
signed chain is complete, so workers waiting for a valid pointer join without waiting for a first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout
from worker_contract.anchor import AnchorError, read_manifest
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, parse_pointer, read_pointer
from worker_contract.pulse import PatchError, verify_patch_signature
from worker_contract.store import NotFound, PreconditionFailed, Store

from .publish_claims import PublishError

log = logging.getLogger(__name__)


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
