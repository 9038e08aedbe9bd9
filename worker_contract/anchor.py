"""Anchors: a full plane state as safetensors shards plus a signed manifest with per-tensor digests.

    <run>/anchors/v<version>/weights-<shard>.safetensors   tensors in name order, split at ~shard_bytes
    <run>/anchors/v<version>/manifest.json                 `AnchorManifest`, written last, signed

Shards are written create-only, each read back (size and ETag) before the next step; the manifest goes
last, so an anchor without a manifest is an incomplete attempt that readers ignore. A reader checks the
manifest's signature, each shard's digest, each tensor's digest, dtype and shape, and the state digest.
Digests are BLAKE3 (`tensors.DIGEST_ALG`, named in the manifest).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import blake3
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import layout, safetensors_np, signing
from .store import NotFound, PreconditionFailed, Store
from .tensors import DIGEST_ALG, blake3_hex, digest_of_entries, dtype_name, tensor_digest

#: 2: BLAKE3 digests (`digest` fields, `digest_alg`); 1 had sha256
ANCHOR_FORMAT = 2
DEFAULT_SHARD_BYTES = 2 << 30
#: a shard being written goes to the temp dir as stoa-anchor-<writer pid>-<random>.safetensors
_SHARD_TMP_PREFIX = "stoa-anchor-"
_SIG_CONTEXT = b"stoa-anchor-manifest\0"

#: progress(bytes_done, bytes_total) during an anchor upload or download
Progress = Callable[[int, int], None]


class AnchorError(ValueError):
    """An anchor that is missing, incomplete, unsigned/forged, or does not match its digests."""


class VersionTaken(AnchorError):
    """Objects for this version already exist (an earlier attempt); publish at a higher version."""


class AnchorTensor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Tensor name in the plane.")
    dtype: str = Field(description="Canonical dtype name.")
    shape: list[int] = Field(description="Shape.")
    digest: str = Field(description="BLAKE3 (hex) of the tensor's raw bytes.")
    shard: int = Field(ge=0, description="Index of the shard that holds it.")


class AnchorShard(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, description="Shard index (its key is layout.anchor_shard_key(run, version, index)).")
    size: int = Field(ge=0, description="Bytes of the shard file.")
    digest: str = Field(description="BLAKE3 (hex) of the shard file.")


class AnchorManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = Field(ANCHOR_FORMAT, description="Manifest format version.")
    digest_alg: Literal["blake3"] = Field(DIGEST_ALG, description="Algorithm of every digest here (tensors.DIGEST_ALG).")
    run: str = Field(description="Run id.")
    version: int = Field(ge=1, description="Policy version the anchor holds.")
    plane: str = Field(description="Weight plane (bf16 / int8g64).")
    state_digest: str = Field(description="tensors.digest_of_entries over `tensors`: equals a patch's result digest.")
    tensors: list[AnchorTensor] = Field(description="Every tensor, sorted by name.")
    shards: list[AnchorShard] = Field(description="The shards, by index.")
    created_at: float = Field(description="Unix time of publication.")
    signature: str = Field("", description="Base64 Ed25519 over the manifest without this field.")

    def signing_bytes(self) -> bytes:
        return signing.body_bytes(self, _SIG_CONTEXT)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True).encode()

    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


def _plan_shards(state: Mapping[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        n = state[name].nbytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


class _HashingFile:
    def __init__(self, f):
        self.f, self.h, self.n = f, blake3.blake3(), 0

    def write(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.n += len(b)


def sweep_dead_writers_shards(tmp_dir: str | Path | None = None) -> None:
    """Delete the shard files that killed writers left in the temp dir. A SIGKILL (or a box
    crash) skips the `finally` that removes them, and each is up to 2 GiB: a learner restarted after
    crashes would fill /tmp. Only files named with a PID that runs no more are touched."""
    for path in Path(tmp_dir or tempfile.gettempdir()).glob(f"{_SHARD_TMP_PREFIX}*-*.safetensors"):
        pid = path.name[len(_SHARD_TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _verify_landed(store: Store, key: str, size: int, etag: str) -> None:
    info = store.head(key)
    if info is None or info.size != size or (etag and info.etag.strip('"') != etag.strip('"')):
        raise AnchorError(f"{key} did not land intact (read back {info}, wrote {size} bytes, ETag {etag})")


def write_anchor(store: Store, run: str, version: int, plane: str, state: Mapping[str, np.ndarray],
                 key, *, entries: list[dict] | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Progress | None = None) -> AnchorManifest:
    """Upload `state` (numpy plane tensors) as the anchor of `version`; `VersionTaken` if any of its objects
    exist already. `entries`: per-tensor records the caller already computed (spares hashing again)."""
    known = {e["name"]: e["digest"] for e in entries} if entries else {}
    sweep_dead_writers_shards()
    tensors, shards = [], []
    total, done = sum(a.nbytes for a in state.values()), 0
    for index, names in enumerate(_plan_shards(state, shard_bytes)):
        skey = layout.anchor_shard_key(run, version, index)
        fd, tmp = tempfile.mkstemp(prefix=f"{_SHARD_TMP_PREFIX}{os.getpid()}-", suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                hf = _HashingFile(f)
                safetensors_np.write({n: state[n] for n in names}, hf, {"format": "pt", "stoa_run": run,
                                                                        "stoa_version": str(version)})
            try:
                etag = store.upload_file(skey, tmp, if_absent=True)
            except PreconditionFailed:
                raise VersionTaken(f"{skey} exists: version {version} was used by an earlier attempt") from None
            _verify_landed(store, skey, hf.n, etag)
        finally:
            Path(tmp).unlink(missing_ok=True)
        shards.append(AnchorShard(index=index, size=hf.n, digest=hf.h.hexdigest()))
        for n in names:
            a = state[n]
            tensors.append(AnchorTensor(name=n, dtype=dtype_name(a), shape=list(a.shape),
                                        digest=known.get(n) or tensor_digest(a), shard=index))
            done += a.nbytes
        if progress:
            progress(done, total)
    manifest = AnchorManifest(run=run, version=version, plane=plane, tensors=tensors, shards=shards,
                              created_at=time.time(),
                              state_digest=digest_of_entries([t.model_dump() for t in tensors]))
    manifest = manifest.model_copy(update={"signature": signing.sign(key, manifest.signing_bytes())})
    mkey = layout.anchor_manifest_key(run, version)
    data = manifest.to_bytes()
    try:
        etag = store.put_if_absent(mkey, data)
    except PreconditionFailed:
        raise VersionTaken(f"{mkey} exists: version {version} was used by an earlier attempt") from None
    _verify_landed(store, mkey, len(data), etag)
    return manifest


def read_manifest(store: Store, run: str, version: int, public_key: str) -> AnchorManifest:
    """The anchor's manifest, signature checked; AnchorError if absent or not genuine."""
    key = layout.anchor_manifest_key(run, version)
    try:
        raw = store.get(key)
    except NotFound:
        raise AnchorError(f"anchor v{version} has no manifest ({key})") from None
    try:
        fmt = json.loads(raw).get("format")
    except (ValueError, AttributeError):
        fmt = None
    if fmt != ANCHOR_FORMAT:
        raise AnchorError(f"{key} has anchor format {fmt!r}; this reader knows format {ANCHOR_FORMAT} "
                          "(publisher and worker must run the same contract release)")
    try:
        m = AnchorManifest.model_validate_json(raw)
    except ValidationError as e:
        raise AnchorError(f"{key} is not a valid anchor manifest: {e.errors()[0]['msg']}") from None
    try:
        signing.verify(public_key, m.signing_bytes(), m.signature or None)
    except signing.SignatureError as e:
        raise AnchorError(f"anchor v{version} manifest refused: {e}") from None
    if m.run != run or m.version != version or m.format != ANCHOR_FORMAT:
        raise AnchorError(f"{key} names run {m.run!r} version {m.version} format {m.format}, not "
                          f"run {run!r} version {version} format {ANCHOR_FORMAT}")
    if digest_of_entries([t.model_dump() for t in m.tensors]) != m.state_digest:
        raise AnchorError(f"anchor v{version}: the manifest's state digest does not match its tensor list")
    return m


def _shard_bytes(store: Store, run: str, version: int, shard) -> bytes:
    """One shard's bytes, checked against its manifest entry's size and digest (AnchorError names the damage)."""
    key = layout.anchor_shard_key(run, version, shard.index)
    try:
        data = store.get(key)
    except NotFound:
        raise AnchorError(f"anchor v{version} shard {shard.index} is missing ({key})") from None
    if len(data) != shard.size or blake3_hex(data) != shard.digest:
        raise AnchorError(f"anchor v{version} shard {shard.index} does not match its manifest digest")
    return data


def check_anchor(store: Store, run: str, version: int, public_key: str) -> AnchorManifest:
    """The anchor's manifest after checking that every shard it lists is there, of its size and digest (one
    shard in memory at a time, no tensor decoded); AnchorError names the first damage. What `read_anchor`
    would refuse at the shard level, for a caller that must know an anchor is usable before relying on it."""
    m = read_manifest(store, run, version, public_key)
    for shard in m.shards:
        _shard_bytes(store, run, version, shard)
    return m


def read_anchor(store: Store, run: str, version: int, public_key: str, *,
                progress: Progress | None = None) -> tuple[AnchorManifest, dict[str, np.ndarray]]:
    """(manifest, plane state) of an anchor, every digest and the signature checked."""
    m = read_manifest(store, run, version, public_key)
    want = {t.name: t for t in m.tensors}
    state: dict[str, np.ndarray] = {}
    done, total = 0, m.total_bytes()
    for shard in m.shards:
        data = _shard_bytes(store, run, version, shard)
        tensors, _meta = safetensors_np.load(data)
        for name, arr in tensors.items():
            t = want.get(name)
            if t is None or t.shard != shard.index:
                raise AnchorError(f"anchor v{version} shard {shard.index} holds {name}, which its manifest does not list there")
            if dtype_name(arr) != t.dtype or list(arr.shape) != t.shape or tensor_digest(arr) != t.digest:
                raise AnchorError(f"anchor v{version} tensor {name} does not match its manifest digest")
            state[name] = arr
        done += len(data)
        if progress:
            progress(done, total)
    missing = sorted(set(want) - set(state))
    if missing:
        raise AnchorError(f"anchor v{version} lacks tensors its manifest lists: {', '.join(missing[:5])}")
    return m, state


def anchor_versions(store: Store, run: str) -> list[int]:
    """Versions with an anchor manifest (complete anchors), ascending."""
    out = []
    for info in store.list(layout.anchors_prefix(run)):
        try:
            v = layout.anchor_version_of(info.key)
        except ValueError:  # a key the layout never makes (anyone with credentials can write one): not ours
            continue
        if v is not None:
            out.append(v)
    return sorted(out)
