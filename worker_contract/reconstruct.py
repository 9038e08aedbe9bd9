"""The worker side of weight sync: cold join from an anchor, then follow the pointer patch by patch.

    rec = Reconstructor(store, run, plane="int8g64", n_samples=8)
    version, state = rec.join()          # newest anchor at or below the pointer, plus patches up to it
    update = rec.follow()                # (version, state) when the pointer moved, else None
    update = rec.follow(behind=4)        # the same, but never past pointer - 4 (a worker lagging on purpose)
More in docs/pulse.md (module notes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from . import layout
from .anchor import AnchorError, anchor_versions, read_anchor
from .manifest import ContractMismatch, RunManifest, load_manifest
from .planes import get_plane
from .pointer import PointerError, read_pointer
from .pulse import PatchError, apply_patch, read_header, verify_patch_signature
from .store import NotFound, Store
from .tensors import sorted_positions

#: progress(stage, done, total): stage is "anchor" (bytes) or "patches" (count)
JoinProgress = Callable[[str, int, int], None]


class SyncError(RuntimeError):
    """Weight sync failed at some step; the last good state is kept."""


class PointerRefused(SyncError):
    """`current.json` does not verify under the run's key (anyone with bucket credentials can write it): no
    version to join or follow until the trainer writes a valid one."""


class Reconstructor:
    def __init__(self, store: Store, run: str, *, plane: str, n_samples: int | None = None,
                 public_key: str | None = None, progress: JoinProgress | None = None):
        get_plane(plane)  # an unknown plane name is refused with the known ones
        layout.check_run_id(run)
        try:
            self.manifest: RunManifest = load_manifest(store, run)
        except NotFound:
            raise SyncError(f"run {run!r} has no run.json in {store.url}: check DRL_RUN and DRL_STORE") from None
        if self.manifest.plane != plane:
            raise ContractMismatch(f"DRL_PULSE_PLANE={plane!r} but run {run!r} publishes plane "
                                   f"{self.manifest.plane!r}: set DRL_PULSE_PLANE={self.manifest.plane}")
        if n_samples is not None and self.manifest.n_samples != n_samples:
            raise ContractMismatch(f"DRL_N_SAMPLES={n_samples} but run {run!r} requires n_samples="
                                   f"{self.manifest.n_samples}: set DRL_N_SAMPLES={self.manifest.n_samples}")
        if public_key is not None and public_key != self.manifest.trainer_public_key:
            raise ContractMismatch(f"run {run!r} is signed by a key other than the one you were given "
                                   "(compare the join card's fingerprint); refusing to follow it")
        self.store, self.run, self.plane = store, run, plane
        self.public_key = public_key or self.manifest.trainer_public_key
        self.progress = progress
        self.version: int | None = None
        self.state: dict[str, np.ndarray] | None = None
        self.digest: str | None = None
        self.changes: dict[str, np.ndarray] | None = None
        """What the last join/follow changed: tensor name -> sorted flat element indices, for a worker that
        rewrites only those; None = everything (a join, or an anchor entered on the way)."""

    # -- public ------------------------------------------------------------------------------------------
    def join(self, behind: int = 0) -> tuple[int, dict[str, np.ndarray]]:
        """Cold join: the newest anchor at or below the pointer, then patches up to the pointer.

        `behind` > 0 stops `behind` versions short of the pointer (a worker that lags on purpose, for
        staleness experiments); where the run has no version that old yet, it joins at its oldest anchor."""
        pointer = self._pointer()
        if pointer is None:
            raise SyncError(f"run {self.run!r} has published no weights yet (no current.json)")
        target, anchor = self._target(pointer, behind)
        version, state, digest = self._load_anchor(anchor)
        version, state, digest = self._walk(version, state, digest, max(target, anchor), progress=True)
        self._check_pointer_digest(pointer, version, digest)
        self.version, self.state, self.digest, self.changes = version, state, digest, None
        return version, state

    def follow(self, behind: int = 0) -> tuple[int, dict[str, np.ndarray]] | None:
        """Apply what was published since the last join/follow; None when the pointer has not moved.

        With `behind` > 0 it moves only up to `behind` versions short of the pointer: every version on the way
        is still checked patch by patch against the signed chain."""
        if self.state is None:
            return self.join(behind)
        pointer = self._pointer()
        if pointer is None:
            return None
        target, anchor = self._target(pointer, behind)
        if target <= self.version:
            return None
        changes: dict[str, np.ndarray] | None = {}
        try:
            version, state, digest = self._walk(self.version, self.state, self.digest, target, changes=changes)
        except SyncError:
            if anchor <= self.version:
                raise
            # something on the way does not verify (anyone with bucket write access can squat a version the
            # trainer then skipped); the signed pointer names a newer anchor: enter there, as a joiner would
            version, state, digest = self._load_anchor(anchor)
            version, state, digest = self._walk(version, state, digest, target)
            changes = None
        self._check_pointer_digest(pointer, version, digest)
        self.version, self.state, self.digest = version, state, digest
        self.changes = changes if changes is None or "" not in changes else None
        return version, state

    # -- steps -------------------------------------------------------------------------------------------
    def _target(self, pointer, behind: int) -> tuple[int, int]:
        """(version to reach, anchor to enter at) for a follower `behind` versions short of the pointer."""
        if behind < 0:
            raise ValueError(f"behind={behind} must be at least 0")
        if behind == 0:
            return pointer.version, pointer.anchor_version
        target = pointer.version - behind
        anchors = anchor_versions(self.store, self.run)
        below = [a for a in anchors if a <= target]
        if below:
            return target, below[-1]
        oldest = anchors[0] if anchors else pointer.anchor_version
        return max(target, oldest), oldest  # the run is younger than the lag: its oldest weights

    def _pointer(self):
        try:
            return read_pointer(self.store, self.run, self.public_key)[0]
        except PointerError as e:
            raise PointerRefused(str(e)) from None

    def _load_anchor(self, version: int):
        def bytes_progress(done: int, total: int) -> None:
            if self.progress:
                self.progress("anchor", done, total)
        try:
            m, state = read_anchor(self.store, self.run, version, self.public_key, progress=bytes_progress)
        except AnchorError as e:
            raise SyncError(str(e)) from None
        if m.plane != self.plane:
            raise SyncError(f"anchor v{version} is in plane {m.plane!r}, the run's is {self.plane!r}")
        return version, state, m.state_digest

    def _walk(self, version: int, state, digest: str, target: int, *, progress: bool = False,
              changes: dict[str, np.ndarray] | None = None):
        """Patches version+1..target. Where a version has no patch (the chain restarted with an anchor after
        a resume, or an attempt crashed before its objects were complete), enter at the next anchor.
        `changes` accumulates what the patches changed (key "" marks an anchor entered: everything)."""
        v = version + 1
        while v <= target:
            try:
                patch = self.store.get(layout.patch_key(self.run, v))
            except NotFound:
                anchors = [a for a in anchor_versions(self.store, self.run) if v <= a <= target]
                if not anchors:
                    raise SyncError(f"v{v} has no patch and no anchor follows it up to v{target}") from None
                version, state, digest = self._load_anchor(anchors[0])
                if changes is not None:
                    changes[""] = np.zeros(0, np.int64)
                v = version + 1
                continue
            try:
                header = verify_patch_signature(patch, self.public_key)
                if header.base_version != version or header.target_version != v or header.base_digest != digest:
                    raise PatchError(f"patch v{v} is for base v{header.base_version} ({header.base_digest[:19]}), "
                                     f"this worker holds v{version} ({digest[:19]})")
                step: dict[str, np.ndarray] = {}
                state = apply_patch(state, patch, verified_base_digest=digest, changes_out=step)
                if changes is not None:
                    merge_changes(changes, step, state)
            except PatchError as e:
                raise SyncError(f"v{v}: {e}") from None
            version, digest = v, header.result_digest
            if progress and self.progress:
                self.progress("patches", v, target)
            v += 1
        return version, state, digest

    def _check_pointer_digest(self, pointer, version: int, digest: str) -> None:
        if version < pointer.version:
            return  # a lagging follower: the chain's patch digests were checked on the way
        if version != pointer.version or digest != pointer.result_digest:
            raise SyncError(f"reconstructed v{version} has digest {digest}, the pointer names v{pointer.version} "
                            f"with {pointer.result_digest}")


def merge_changes(into: dict[str, np.ndarray], step: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> None:
    """Add what one step changed (tensor name -> sorted flat positions) to `into`: the union, tensor by tensor,
    each within its size in `state`."""
    for name, idx in step.items():
        into[name] = sorted_positions(into[name], idx, size=state[name].size) if name in into else idx


def read_patch_header(store: Store, run: str, version: int):
    """The header of a published patch (for tooling); NotFound if absent."""
    return read_header(store.get(layout.patch_key(run, version)))
