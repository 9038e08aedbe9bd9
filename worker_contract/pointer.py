"""`current.json`: the signed version pointer, the only object in a run that is ever overwritten.

The trainer writes it last, after every object it names landed and was read back, by compare-and-swap on
its ETag, and never to a lower version. Workers follow it; a pointer that does not verify under the run's
key is refused.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import layout, signing
from .store import NotFound, PreconditionFailed, Store

POINTER_FORMAT = 1
_SIG_CONTEXT = b"stoa-pointer\0"


class PointerError(ValueError):
    """A pointer that is malformed, unsigned or forged, or would move backwards."""


class Pointer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = Field(POINTER_FORMAT, description="Pointer format version.")
    run: str = Field(description="Run id.")
    version: int = Field(ge=1, description="The newest published policy version.")
    anchor_version: int = Field(ge=1, description="Newest anchor at or below `version` (where a cold join starts).")
    result_digest: str = Field(description="State digest of `version` (tensors.digest_of_entries).")
    published_at: float = Field(description="Unix time the pointer was written.")
    signature: str = Field("", description="Base64 Ed25519 over the pointer without this field.")

    def signing_bytes(self) -> bytes:
        return signing.body_bytes(self, _SIG_CONTEXT)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()


def make_pointer(run: str, version: int, anchor_version: int, result_digest: str, key) -> Pointer:
    p = Pointer(run=run, version=version, anchor_version=anchor_version, result_digest=result_digest,
                published_at=time.time())
    return p.model_copy(update={"signature": signing.sign(key, p.signing_bytes())})


def parse_pointer(raw: bytes, run: str, public_key: str | None) -> Pointer:
    try:
        p = Pointer.model_validate_json(raw)
    except ValidationError as e:
        raise PointerError(f"{layout.pointer_key(run)} is not a valid pointer: {e.errors()[0]['msg']}") from None
    if p.run != run or p.anchor_version > p.version:
        raise PointerError(f"{layout.pointer_key(run)} names run {p.run!r}, version {p.version}, anchor "
                           f"{p.anchor_version}: not a pointer of run {run!r}")
    if public_key is not None:
        try:
            signing.verify(public_key, p.signing_bytes(), p.signature or None)
        except signing.SignatureError as e:
            raise PointerError(f"pointer refused: {e}") from None
    return p


def read_pointer(store: Store, run: str, public_key: str | None) -> tuple[Pointer | None, str | None]:
    """(pointer, ETag), or (None, None) before the first publish. Signature checked when a key is given."""
    try:
        raw, etag = store.get_with_etag(layout.pointer_key(run))
    except NotFound:
        return None, None
    return parse_pointer(raw, run, public_key), etag


def advance_pointer(store: Store, new: Pointer, public_key: str) -> str:
    """Write `new` by compare-and-swap, refusing to move the pointer backwards or sideways.

    Retries the swap only when the pointer changed under us and still sits below `new.version`.
    """
    key = layout.pointer_key(new.run)
    for _ in range(8):
        current, etag = read_pointer(store, new.run, public_key)
        if current is not None and current.version >= new.version:
            raise PointerError(f"pointer is at v{current.version}; refusing to move it to v{new.version}")
        try:
            if etag is None:
                return store.put_if_absent(key, new.to_bytes())
            return store.put_if_match(key, new.to_bytes(), etag)
        except (PreconditionFailed, NotFound):
            continue
    raise PointerError(f"{key} kept changing while writing v{new.version}; is another publisher running?")
