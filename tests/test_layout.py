"""Bucket keys: the one module that builds and parses them (docs/contract.md)."""

from __future__ import annotations

import pytest

from worker_contract import layout


@pytest.mark.parametrize("run", ["a", "gsm8k-2026-11-30a", "run.1_b", "0abc", "x" * 63])
def test_valid_run_ids(run):
    assert layout.check_run_id(run) == run
    assert layout.run_prefix(run) == f"{run}/"


@pytest.mark.parametrize("run", ["", "Upper", "-lead", ".lead", "a/b", "a b", "x" * 64, "run\n", "ü", None, 7])
def test_invalid_run_ids_say_what_is_allowed(run):
    with pytest.raises(ValueError, match="DRL_RUN=.*1-63 characters"):
        layout.check_run_id(run)


def test_run_keys():
    assert layout.manifest_key("r1") == "r1/run.json"
    assert layout.pointer_key("r1") == "r1/current.json"
    assert layout.anchor_manifest_key("r1", 1) == "r1/anchors/v0000000001/manifest.json"
    assert layout.anchor_shard_key("r1", 12, 3) == "r1/anchors/v0000000012/weights-00003.safetensors"
    assert layout.patch_key("r1", 2) == "r1/versions/v0000000002.pulse"
    assert layout.rollout_key("r1", 5, "mac-1", "g42") == "r1/rollouts/v0000000005/mac-1/g42.json.zst"
    assert layout.stats_key("r1", 9) == "r1/stats/v0000000009.json"
    assert layout.probe_key("r1", "abc123") == "r1/probes/abc123"
    assert layout.base_prefix("lfm25") == "bases/lfm25/"
    for key in (layout.pointer_key("r1"), layout.patch_key("r1", 3), layout.rollout_key("r1", 1, "w", "g")):
        assert key.startswith(layout.run_prefix("r1"))


def test_listing_order_is_version_order():
    versions = [1, 2, 9, 10, 11, 99, 100, 12345, 9_999_999_999]
    keys = [layout.patch_key("r", v) for v in versions if v >= 2]
    assert sorted(keys) == keys
    assert [layout.patch_version_of(k) for k in keys] == [v for v in versions if v >= 2]
    prefixes = [layout.rollout_version_prefix("r", v) for v in versions]
    assert sorted(prefixes) == prefixes


def test_rollout_key_round_trip():
    key = layout.rollout_key("my-run", 77, "worker.A_1", "grp-9")
    parsed = layout.parse_rollout_key(key)
    assert parsed == layout.RolloutKey(run="my-run", version=77, worker_id="worker.A_1", group_id="grp-9")
    assert key.startswith(layout.rollout_version_prefix("my-run", 77))


@pytest.mark.parametrize("key", ["r/rollouts/v0000000001/w/g.json", "r/rollouts/v1/w/g.json.zst",
                                 "r/rollouts/v0000000001/g.json.zst", "r/versions/v0000000002.pulse",
                                 "r/rollouts/v0000000001/w/../g.json.zst"])
def test_parse_rollout_key_refuses_other_keys(key):
    with pytest.raises(ValueError):
        layout.parse_rollout_key(key)


def test_version_parsers():
    assert layout.anchor_version_of("r/anchors/v0000000010/manifest.json") == 10
    assert layout.anchor_version_of("r/anchors/v0000000010/weights-00000.safetensors") is None
    assert layout.patch_version_of("r/run.json") is None
    with pytest.raises(ValueError):
        layout.anchor_version_of("r/anchors/v12/manifest.json")
    with pytest.raises(ValueError):  # non-ASCII digits would parse to a version yet sort elsewhere
        layout.patch_version_of("r/versions/v\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0662.pulse")


@pytest.mark.parametrize("call", [
    lambda: layout.patch_key("r", 1),  # version 1 is the base anchor
    lambda: layout.patch_key("r", 0),
    lambda: layout.anchor_prefix("r", -1),
    lambda: layout.anchor_prefix("r", 10**10),
    lambda: layout.anchor_prefix("r", True),
    lambda: layout.anchor_shard_key("r", 1, 100000),
    lambda: layout.rollout_key("r", 1, "a/b", "g"),
    lambda: layout.rollout_key("r", 1, "w", ".hidden"),
    lambda: layout.rollout_key("r", 1, "w", ""),
    lambda: layout.rollout_key("r", 1, "w", "g\n"),  # `$` alone would let a trailing newline through
    lambda: layout.probe_key("r", "../x"),
    lambda: layout.manifest_key("Bad/Run"),
])
def test_bad_parts_are_refused(call):
    with pytest.raises(ValueError):
        call()
