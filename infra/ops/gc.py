"""`invoke gc --run <id> [--keep-anchors K]`: delete what no joiner can need any more.

A joiner starts from the anchor the pointer names (the newest at or below it) and applies patches up to
the pointer (docs/contract.md). Keeping the newest K anchors at or below the pointer (always including the
pointer's own), and every patch after the oldest of them, keeps every kept anchor a valid starting point.
More in docs/operations.md (module notes).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from worker_contract import layout
from worker_contract.anchor import AnchorError, anchor_versions, check_anchor
from worker_contract.pointer import PointerError
from worker_contract.store import Store

from .cost import storage_usd_per_month
from .status import read_manifest, read_pointer


class GcError(ValueError):
    """gc cannot run safely on this run (no pointer, no anchor at or below it, bad K)."""


class GcPlan(BaseModel):
    """What gc will delete and why; `--dry-run` prints it and stops."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    run: str
    """The run id."""
    pointer_version: int
    """The version the pointer named when the plan was made."""
    pointer_anchor: int
    """The anchor that pointer names (a cold joiner's start): always kept."""
    kept_anchors: list[int]
    """Anchor versions kept (the newest K at or below the pointer, plus any above it)."""
    staleness: int
    """The run's staleness bound (run.json)."""
    anchor_keys: list[str]
    """Keys of the anchors that go (manifests first)."""
    patch_keys: list[str]
    """Patches that go, newest first."""
    rollout_keys: list[str]
    """Rollout records that go."""
    bytes_freed: int
    """Total size of everything that goes."""

    @property
    def keys(self) -> list[str]:
        """Deletion order: patches newest first, then anchors, then rollouts. Whatever prefix of it has run,
        every remaining patch still chains from a remaining anchor, so `worker_contract verify` passes at
        every instant (a patch left without its base would fail it)."""
        return [*self.patch_keys, *self.anchor_keys, *self.rollout_keys]

    def summary(self) -> str:
        usd = storage_usd_per_month(self.bytes_freed)
        return (f"run {self.run}: pointer v{self.pointer_version}, keeping anchors "
                f"{', '.join(f'v{v}' for v in self.kept_anchors)}; deleting {len(self.anchor_keys)} anchor "
                f"objects, {len(self.patch_keys)} patches, {len(self.rollout_keys)} rollouts "
                f"({self.bytes_freed:,} bytes, ${usd:.4f}/month of R2 storage)")


def _anchor_objects(store: Store, run: str, drop: set[int]) -> tuple[list[str], int]:
    manifests, shards, size = [], [], 0
    for o in store.list(layout.anchors_prefix(run)):
        if _version_in(o.key, run) not in drop:
            continue
        (manifests if o.key.endswith("/manifest.json") else shards).append(o.key)
        size += o.size
    return manifests + shards, size


def _patch_objects(store: Store, run: str, up_to: int) -> tuple[list[str], int]:
    keys, size = [], 0
    if up_to < 2:
        return keys, size
    last = layout.patch_key(run, up_to)
    for o in store.list(layout.versions_prefix(run)):
        if o.key > last:
            break  # keys sort by version: the rest are needed
        if layout.patch_version_of(o.key) is not None:
            keys.append(o.key)
            size += o.size
    return keys[::-1], size


def _rollout_objects(store: Store, run: str, below: int) -> tuple[list[str], int]:
    keys, size = [], 0
    if below < 2:
        return keys, size
    stop = layout.rollout_version_prefix(run, below)
    for o in store.list(layout.rollouts_prefix(run)):
        if o.key >= stop:
            break  # listing is in key order and version prefixes sort numerically: bounded by what goes
        keys.append(o.key)
        size += o.size
    return keys, size


def plan_gc(store: Store, run: str, keep_anchors: int) -> GcPlan:
    """Work out what may go, without deleting anything."""
    if not isinstance(keep_anchors, int) or keep_anchors < 1:
        raise GcError(f"--keep-anchors={keep_anchors!r} must be at least 1: a joiner needs an anchor to start")
    manifest = read_manifest(store, run)
    if manifest is None:
        raise GcError(f"run {run!r} has no run.json in {store.url}: nothing is published, nothing to collect")
    try:  # a forged pointer must never steer a deletion: it is verified under run.json's key
        ptr = read_pointer(store, run, manifest.trainer_public_key)
    except PointerError as e:
        raise GcError(f"run {run!r}: {e}; gc deletes nothing while the pointer does not verify") from None
    if ptr is None:
        raise GcError(f"run {run!r} has no pointer in {store.url}: nothing is published, nothing to collect")
    pointer = ptr.version
    anchors = anchor_versions(store, run)
    usable = [v for v in anchors if v <= pointer]
    if not usable or ptr.anchor_version not in anchors:
        raise GcError(f"run {run!r}: the pointer v{pointer} names anchor v{ptr.anchor_version}, which is not a "
                      "complete anchor; a joiner could not start, so gc deletes nothing (check the run with "
                      "python -m worker_contract verify)")
    try:  # every joiner starts there: a damaged one leaves the older anchors and patches the only route
        check_anchor(store, run, ptr.anchor_version, manifest.trainer_public_key)
    except AnchorError as e:
        raise GcError(f"run {run!r}: the pointer's own anchor is damaged ({e}); the older anchors and patches "
                      "are the only route left to these weights, so gc deletes nothing (check the run with "
                      "python -m worker_contract verify)") from None
    kept_usable = sorted(set(usable[-keep_anchors:]) | {ptr.anchor_version})
    oldest_kept = kept_usable[0]
    kept = sorted(set(kept_usable) | {v for v in anchors if v > pointer})
    drop = {v for v in anchors if v < oldest_kept}
    anchor_keys, a_bytes = _anchor_objects(store, run, drop)
    patch_keys, p_bytes = _patch_objects(store, run, oldest_kept - 1)
    rollout_keys, r_bytes = _rollout_objects(store, run, pointer - manifest.staleness)
    plan = GcPlan(run=run, pointer_version=pointer, pointer_anchor=ptr.anchor_version, kept_anchors=kept,
                  staleness=manifest.staleness, anchor_keys=anchor_keys, patch_keys=patch_keys, rollout_keys=rollout_keys,
                  bytes_freed=a_bytes + p_bytes + r_bytes)
    check_plan(plan)
    return plan


def _version_in(key: str, run: str) -> int | None:
    """The version segment of an anchor, patch or rollout key."""
    rest = key[len(layout.run_prefix(run)):].split("/")
    if rest[0] == "versions":
        return layout.patch_version_of(key)
    seg = rest[1] if len(rest) > 1 else ""
    return int(seg[1:]) if seg.startswith("v") and seg[1:].isdigit() else None


def check_plan(plan: GcPlan) -> None:
    """Our own invariants (a failure here is a bug in this module, never user input)."""
    newest_kept = max(plan.kept_anchors)
    allowed = (layout.anchors_prefix(plan.run), layout.versions_prefix(plan.run), layout.rollouts_prefix(plan.run))
    for key in plan.keys:
        assert key.startswith(allowed), f"gc planned to delete {key}, outside anchors/versions/rollouts"
        v = _version_in(key, plan.run)
        assert v is not None, f"gc planned to delete {key}, which names no version"
        if not key.startswith(layout.rollouts_prefix(plan.run)):  # weights: the pointer names two versions
            assert v not in (plan.pointer_version, plan.pointer_anchor), f"gc planned to delete {key}, which the pointer names"
            assert v < newest_kept, f"gc planned to delete {key}, at or above the newest kept anchor"
        else:  # rollouts sampled at the pointer's anchor (a resume anchors inside the window's tail) may go
            assert v < plan.pointer_version - plan.staleness, f"gc planned to delete {key}, inside the window"


def apply_gc(store: Store, plan: GcPlan, advance: Callable[[float], None] = lambda n=1: None) -> int:
    """Delete what the plan names, in `plan.keys` order; returns the number of keys deleted."""
    check_plan(plan)
    for key in plan.keys:
        store.delete(key)
        advance(1)
    return len(plan.keys)
