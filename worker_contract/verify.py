"""Check a run's published weights end to end: every version from the anchors, one line each.

For each version up to the pointer: its patch (signature, base and result digests, applied to the previous
version's state) and its anchor (signature, shard and tensor digests), and that both agree where a version
has both. A version with no complete objects is an interrupted attempt that the pointer skipped, or, below
the oldest anchor left, collected (`invoke gc` deletes what no joiner can need; a run's first anchor is v1);
it is reported, and only a failure if something needed it. Finally the pointer's signature and digest;
a missing pointer is a failure once versions past v1 exist (it was deleted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import layout
from .anchor import AnchorError, read_anchor
from .manifest import load_manifest
from .pointer import Pointer, PointerError, read_pointer
from .pulse import PatchError, apply_patch, verify_patch_signature
from .store import NotFound, Store


def _versions(store: Store, prefix: str, version_of: Callable[[str], int | None]) -> set[int]:
    """Versions of the keys under `prefix`; keys the layout does not make (anyone with bucket credentials
    can write one) are not the trainer's and are left out."""
    out = set()
    for info in store.list(prefix):
        try:
            v = version_of(info.key)
        except ValueError:
            continue
        if v is not None:
            out.add(v)
    return out


def _no_pointer(run: str, published: set[int], out: Callable[[str], None]) -> bool:
    """No current.json: a run that published nothing yet, or whose first publish was interrupted (v1's objects
    are written before the pointer), is well. Objects past v1 mean a pointer once stood at v1 or later (the
    publisher writes version v only after the pointer reached v-1): it was deleted, and joiners cannot start."""
    if not published or max(published) <= 1:
        extra = " (v1's objects from an interrupted first publish)" if published else " (nothing published)"
        out(f"run {run!r}: no current.json yet{extra}; 0 versions")
        return True
    out(f"FAIL current.json is missing, but the bucket holds versions up to v{max(published)}: the pointer was "
        f"deleted, and a joiner finds no version to start from")
    return False


@dataclass
class _Walk:
    """What the walk carries from version to version: the state the chain reached (None where it broke) and
    its digest, and the versions it found missing."""

    store: Store
    run: str
    key: str
    plane: str
    anchors: set[int]
    patches: set[int]
    state: Any = None
    digest: str | None = None
    skipped: int = 0
    collected: int = 0

    @property
    def oldest(self) -> int | None:
        """The oldest anchor: every version below it is gone on purpose (gc collected it)."""
        return min(self.anchors) if self.anchors else None

    def version(self, v: int, is_pointer: bool) -> tuple[bool, list[str]]:
        """Check version `v` (its patch, its anchor, or why it has neither); (ok, one note per object)."""
        notes: list[str] = []
        ok = True
        if v in self.patches:
            ok = self._patch(v, notes)
        else:
            self.state = None  # this version does not continue the chain; only its anchor can enter it
        if v in self.anchors:
            ok = self._anchor(v, notes) and ok
        if v not in self.patches and v not in self.anchors:
            ok = self._missing(v, is_pointer, notes)
        return ok, notes

    def _patch(self, v: int, notes: list[str]) -> bool:
        """The patch to `v`: signed, and applied where the chain reaches its base."""
        try:
            patch = self.store.get(layout.patch_key(self.run, v))
            header = verify_patch_signature(patch, self.key)
            if self.state is None and v in self.anchors and v == self.oldest and v > 1:
                notes.append(f"patch signed (its base v{v - 1} was collected; entered from the anchor)")
            elif self.state is None and v in self.anchors:
                notes.append("patch signed (its base is not reachable; entered from the anchor)")
            elif self.state is None:
                raise PatchError("its base is not reachable (no earlier chain and no anchor here)")
            elif (header.base_version != v - 1 or header.target_version != v
                  or header.base_digest != self.digest):
                raise PatchError(f"names base v{header.base_version}/target v{header.target_version}, "
                                 f"which does not chain from v{v - 1}")
            else:
                self.state = apply_patch(self.state, patch, verified_base_digest=self.digest)
                self.digest = header.result_digest
                changed = sum(t.changed for t in header.tensors)
                words = sum(t.count for t in header.tensors)
                notes.append(f"patch {len(patch):,} B, {100 * (1 - changed / max(words, 1)):.2f}% unchanged")
        except PatchError as e:
            notes.append(f"patch FAILED: {e}")
            self.state = None
            return False
        return True

    def _anchor(self, v: int, notes: list[str]) -> bool:
        """The anchor at `v`: signed, in the run's plane, and equal to the state the chain reached."""
        try:
            m, astate = read_anchor(self.store, self.run, v, self.key)
            if m.plane != self.plane:
                raise AnchorError(f"plane {m.plane!r}, run.json says {self.plane!r}")
            if self.state is not None and self.digest != m.state_digest:  # the patch to v was applied
                raise AnchorError("its digest differs from the state the patch chain reaches")
            self.state, self.digest = astate, m.state_digest
            notes.append(f"anchor {m.total_bytes():,} B, {len(m.tensors)} tensors")
        except AnchorError as e:
            notes.append(f"anchor FAILED: {e}")
            self.state = None
            return False
        return True

    def _missing(self, v: int, is_pointer: bool, notes: list[str]) -> bool:
        """A version with no complete objects: collected, or an interrupted attempt; a failure only at the pointer."""
        self.state = None
        oldest = self.oldest
        if oldest is not None and v < oldest:
            self.collected += 1
            notes.append(f"collected (below the oldest anchor v{oldest}, where every joiner starts)")
        else:
            self.skipped += 1
            notes.append("no complete objects (an interrupted attempt the pointer skipped)")
        return not is_pointer

    def pointer_failure(self, pointer: Pointer) -> str | None:
        """Why the pointer does not name what the walk reached, or None."""
        if self.state is None or self.digest != pointer.result_digest:
            return f"current.json names v{pointer.version} with {pointer.result_digest}, the walk reached {self.digest}"
        if pointer.anchor_version not in self.anchors:
            return f"current.json names anchor v{pointer.anchor_version}, which is not a complete anchor"
        return None


def _summary(run: str, pointer: Pointer, walk: _Walk, failures: int) -> str:
    beyond = sorted(v for v in walk.anchors | walk.patches if v > pointer.version)
    return (f"run {run!r}: pointer v{pointer.version}, {len(walk.anchors)} anchors, {len(walk.patches)} patches, "
            f"{walk.skipped} skipped, " + (f"{walk.collected} collected, " if walk.collected else "")
            + f"{len(beyond)} beyond the pointer, {failures} failures"
            + (": OK" if not failures else ": FAILED"))


def verify_run(store: Store, run: str, out: Callable[[str], None] = print, *, quiet: bool = False) -> bool:
    """Walk and check every version; prints one line per version (`quiet`: only the failing ones) and a summary;
    True when all is well."""
    try:
        manifest = load_manifest(store, run)
    except NotFound:
        out(f"FAIL run {run!r} has no run.json in {store.url}")
        return False
    key = manifest.trainer_public_key
    try:
        pointer, _ = read_pointer(store, run, key)
    except PointerError as e:
        out(f"FAIL current.json: {e}")
        return False
    walk = _Walk(store, run, key, manifest.plane,
                 anchors=_versions(store, layout.anchors_prefix(run), layout.anchor_version_of),
                 patches=_versions(store, layout.versions_prefix(run), layout.patch_version_of))
    if pointer is None:
        return _no_pointer(run, walk.anchors | walk.patches, out)
    failures = 0
    for v in range(1, pointer.version + 1):
        ok, notes = walk.version(v, is_pointer=v == pointer.version)
        failures += not ok
        if not (ok and quiet):
            out(f"v{v:<6} {'ok  ' if ok else 'FAIL'} {'; '.join(notes)}")
    if (why := walk.pointer_failure(pointer)) is not None:
        failures += 1
        out(f"FAIL {why}")
    out(_summary(run, pointer, walk, failures))
    return failures == 0
