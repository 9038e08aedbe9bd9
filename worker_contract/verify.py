"""Check a run's published weights end to end: every version from the anchors, one line each.

For each version up to the pointer: its patch (signature, base and result digests, applied to the previous
version's state) and its anchor (signature, shard and tensor digests), and that both agree where a version
has both. A version with no complete objects is an interrupted attempt that the pointer skipped, or, below
the oldest anchor left, collected (`invoke gc` deletes what no joiner can need; a run's first anchor is v1);
it is reported, and only a failure if something needed it. Finally the pointer's signature and digest.
"""

from __future__ import annotations

from collections.abc import Callable

from . import layout
from .anchor import AnchorError, read_anchor
from .manifest import load_manifest
from .pointer import PointerError, read_pointer
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


def verify_run(store: Store, run: str, out: Callable[[str], None] = print) -> bool:
    """Walk and check every version; prints one line per version and a summary; True when all is well."""
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
    anchors = _versions(store, layout.anchors_prefix(run), layout.anchor_version_of)
    patches = _versions(store, layout.versions_prefix(run), layout.patch_version_of)
    if pointer is None:
        return _no_pointer(run, anchors | patches, out)
    failures, skipped, collected = 0, 0, 0
    oldest = min(anchors) if anchors else None  # every version below it is gone on purpose: gc collected it
    state, digest = None, None
    for v in range(1, pointer.version + 1):
        notes, ok = [], True
        if v not in patches:
            state = None  # this version does not continue the chain; only its anchor can enter it
        if v in patches:
            try:
                patch = store.get(layout.patch_key(run, v))
                header = verify_patch_signature(patch, key)
                if state is None and v in anchors and v == oldest and v > 1:
                    notes.append(f"patch signed (its base v{v - 1} was collected; entered from the anchor)")
                elif state is None and v in anchors:
                    notes.append("patch signed (its base is not reachable; entered from the anchor)")
                elif state is None:
                    raise PatchError("its base is not reachable (no earlier chain and no anchor here)")
                elif header.base_version != v - 1 or header.target_version != v or header.base_digest != digest:
                    raise PatchError(f"names base v{header.base_version}/target v{header.target_version}, "
                                     f"which does not chain from v{v - 1}")
                else:
                    state = apply_patch(state, patch, verified_base_digest=digest)
                    digest = header.result_digest
                    changed = sum(t.changed for t in header.tensors)
                    words = sum(t.count for t in header.tensors)
                    notes.append(f"patch {len(patch):,} B, {100 * (1 - changed / max(words, 1)):.2f}% unchanged")
            except PatchError as e:
                ok = False
                notes.append(f"patch FAILED: {e}")
                state = None
        if v in anchors:
            try:
                m, astate = read_anchor(store, run, v, key)
                if m.plane != manifest.plane:
                    raise AnchorError(f"plane {m.plane!r}, run.json says {manifest.plane!r}")
                if state is not None and digest != m.state_digest:  # the patch to v was applied
                    raise AnchorError("its digest differs from the state the patch chain reaches")
                state, digest = astate, m.state_digest
                notes.append(f"anchor {m.total_bytes():,} B, {len(m.tensors)} tensors")
            except AnchorError as e:
                ok = False
                notes.append(f"anchor FAILED: {e}")
                state = None
        if v not in patches and v not in anchors:
            state = None
            if v == pointer.version:
                ok = False
            if oldest is not None and v < oldest:
                collected += 1
                notes.append(f"collected (below the oldest anchor v{oldest}, where every joiner starts)")
            else:
                skipped += 1
                notes.append("no complete objects (an interrupted attempt the pointer skipped)")
        failures += not ok
        out(f"v{v:<6} {'ok  ' if ok else 'FAIL'} {'; '.join(notes)}")
    if state is None or digest != pointer.result_digest:
        failures += 1
        out(f"FAIL current.json names v{pointer.version} with {pointer.result_digest}, the walk reached {digest}")
    elif pointer.anchor_version not in anchors:
        failures += 1
        out(f"FAIL current.json names anchor v{pointer.anchor_version}, which is not a complete anchor")
    beyond = sorted(v for v in anchors | patches if v > pointer.version)
    out(f"run {run!r}: pointer v{pointer.version}, {len(anchors)} anchors, {len(patches)} patches, "
        f"{skipped} skipped, " + (f"{collected} collected, " if collected else "")
        + f"{len(beyond)} beyond the pointer, {failures} failures"
        + (": OK" if not failures else ": FAILED"))
    return failures == 0
