"""The signed version pointer (`current.json`): read it, and move it last, never backwards.

The pointer is the only object of a run that is ever overwritten, by compare-and-swap. A `current.json`
that does not verify under the run key is a forgery (written with worker credentials): the next publish
replaces it by compare-and-swap on the forged object's ETag, above every version the run key ever signed
(never behind the last valid pointer), logs a warning and counts it (`forged_pointer_reclaimed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker_contract import layout
from worker_contract.pointer import PointerError, advance_pointer, make_pointer, parse_pointer, read_pointer
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
