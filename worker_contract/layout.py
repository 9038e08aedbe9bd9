"""Bucket keys (contract version 1): the only module that builds or parses them.

Everything of a run lives under `<run>/`. Version numbers are zero-padded to ten digits so that the
store's lexicographic listing order is numeric order, and rollouts are filed under the policy version
that sampled them, so the learner lists only the few version prefixes inside its staleness window:
its listing cost is bounded by that window, never by the run's history.
More in docs/contract.md (module notes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CONTRACT_VERSION = 1
VERSION_DIGITS = 10

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# Worker and group ids become key segments: keep them to a safe, slash-free alphabet.
SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run: str) -> str:
    """Validate a run id (the `DRL_RUN` value) as a bucket prefix."""
    if not isinstance(run, str) or not RUN_ID_RE.fullmatch(run):
        raise ValueError(
            f"DRL_RUN={run!r} is not a valid run id: use 1-63 characters of lowercase letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (for example DRL_RUN=gsm8k-2026-11-30a)"
        )
    return run


def check_segment(value: str, what: str) -> str:
    if not isinstance(value, str) or not SEGMENT_RE.fullmatch(value):
        raise ValueError(
            f"{what}={value!r} is not a valid key segment: use 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return value


def _v(version: int) -> str:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1 or version >= 10**VERSION_DIGITS:
        raise ValueError(f"version={version!r} must be an integer from 1 to {10**VERSION_DIGITS - 1}")
    return f"v{version:0{VERSION_DIGITS}d}"


def _parse_v(text: str) -> int:
    if len(text) != VERSION_DIGITS + 1 or text[0] != "v" or not (text[1:].isascii() and text[1:].isdigit()):
        raise ValueError(f"{text!r} is not a version segment like v{1:0{VERSION_DIGITS}d}")
    return int(text[1:])


def run_prefix(run: str) -> str:
    return f"{check_run_id(run)}/"


def manifest_key(run: str) -> str:
    return f"{run_prefix(run)}run.json"


def pointer_key(run: str) -> str:
    return f"{run_prefix(run)}current.json"


def anchors_prefix(run: str) -> str:
    return f"{run_prefix(run)}anchors/"


def anchor_prefix(run: str, version: int) -> str:
    return f"{anchors_prefix(run)}{_v(version)}/"


def anchor_manifest_key(run: str, version: int) -> str:
    return f"{anchor_prefix(run, version)}manifest.json"


def anchor_shard_key(run: str, version: int, shard: int) -> str:
    if not isinstance(shard, int) or not 0 <= shard < 100000:
        raise ValueError(f"shard={shard!r} must be an integer from 0 to 99999")
    return f"{anchor_prefix(run, version)}weights-{shard:05d}.safetensors"


def anchor_version_of(key: str) -> int | None:
    """The version of an anchor manifest key, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 4 and parts[1] == "anchors" and parts[3] == "manifest.json":
        return _parse_v(parts[2])
    return None


def versions_prefix(run: str) -> str:
    return f"{run_prefix(run)}versions/"


def patch_key(run: str, version: int) -> str:
    """The PULSE patch that turns version-1 into `version`."""
    if version < 2:
        raise ValueError(f"version={version} has no patch: version 1 is the base anchor")
    return f"{versions_prefix(run)}{_v(version)}.pulse"


def patch_version_of(key: str) -> int | None:
    parts = key.split("/")
    if len(parts) == 3 and parts[1] == "versions" and parts[2].endswith(".pulse"):
        return _parse_v(parts[2][: -len(".pulse")])
    return None


def rollouts_prefix(run: str) -> str:
    return f"{run_prefix(run)}rollouts/"


def rollout_version_prefix(run: str, version: int) -> str:
    return f"{rollouts_prefix(run)}{_v(version)}/"


def rollout_key(run: str, version: int, worker_id: str, group_id: str) -> str:
    check_segment(worker_id, "worker_id")
    check_segment(group_id, "group_id")
    return f"{rollout_version_prefix(run, version)}{worker_id}/{group_id}.json.zst"


@dataclass(frozen=True)
class RolloutKey:
    run: str
    version: int
    worker_id: str
    group_id: str


def parse_rollout_key(key: str) -> RolloutKey:
    """Inverse of `rollout_key`; raises ValueError for a key that is not a rollout record."""
    parts = key.split("/")
    if len(parts) != 5 or parts[1] != "rollouts" or not parts[4].endswith(".json.zst"):
        raise ValueError(f"{key!r} is not a rollout key (<run>/rollouts/v<version>/<worker>/<group>.json.zst)")
    run, _, vseg, worker, fname = parts
    return RolloutKey(
        run=check_run_id(run),
        version=_parse_v(vseg),
        worker_id=check_segment(worker, "worker_id"),
        group_id=check_segment(fname[: -len(".json.zst")], "group_id"),
    )


def stats_prefix(run: str) -> str:
    return f"{run_prefix(run)}stats/"


def stats_key(run: str, version: int) -> str:
    return f"{stats_prefix(run)}{_v(version)}.json"


def probe_key(run: str, nonce: str) -> str:
    return f"{run_prefix(run)}probes/{check_segment(nonce, 'nonce')}"


def base_prefix(name: str) -> str:
    """Shared base checkpoints that several runs reuse (e.g. bases/lfm25/)."""
    return f"bases/{check_segment(name, 'base name')}/"


def base_manifest_key(name: str) -> str:
    """The manifest of a shared base (file list with digests, revisions); written last, create-only."""
    return f"{base_prefix(name)}manifest.json"


def base_file_key(name: str, part: str, relpath: str) -> str:
    """One file of a shared base: `part` is `hf` (the HF directory) or `torch_dist` (the converted one)."""
    if part not in ("hf", "torch_dist"):
        raise ValueError(f"part={part!r}: a base holds 'hf' and 'torch_dist' files")
    segs = relpath.split("/")
    if not relpath or any(s in ("", ".", "..") for s in segs) or relpath.startswith("/"):
        raise ValueError(f"relpath={relpath!r} must be a relative path without '.', '..' or empty segments")
    return f"{base_prefix(name)}{part}/{relpath}"
