"""The background follower (worker/follower.py): patches published while a group samples are read, checked
and applied beside it; between groups the worker gets the version at the pointer, bit for bit, with the union
of what every patch on the way changed (a position missed would leave a stale weight in the model)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_reconstruct import _published
from weightsync_helpers import assert_same_bits

from worker_contract.planes import get_plane
from worker_contract.reconstruct import Reconstructor
from worker_contract.tensors import words
from worker_contract.worker.follower import Follower

pytest.importorskip("torch")


def _move_rows(policy, k: int) -> None:
    """Version k moves rows 16k..16k+15 alone: each patch changes positions the others do not."""
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        policy.w[name][16 * k:16 * (k + 1)] += 0.01


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_versions_followed_in_the_background_hand_over_every_change(file_store, plane):
    manifest, _, pub, policy, states = _published(file_store, plane=plane, n=2)
    rec = Reconstructor(file_store, manifest.run, plane=plane, n_samples=8, public_key=manifest.trainer_public_key)
    start, held = rec.join()
    prepared = []  # what the thread prepared: the union of the changes, read out of the newest state

    def prepare(state, changes):
        prepared.append({n: np.asarray(state[n]).reshape(-1)[i] for n, i in changes.items()})
        return prepared[-1]

    follower = Follower(rec, interval_s=0.05, prepare=prepare)
    assert follower.take() is None  # nothing published since the join
    follower.start()
    try:
        for k in range(3):  # three versions while the worker "samples", each followed on its own
            _move_rows(policy, k)
            states[pub.publish(policy.state()).version] = get_plane(plane).from_hf(policy.state())
            deadline = time.monotonic() + 60
            while rec.version != start + k + 1:  # the thread did the work, not take()
                assert time.monotonic() < deadline, "the follower did not move in the background"
                time.sleep(0.02)
        version, state, changes, values = follower.take()
    finally:
        follower.close()
    assert version == start + 3
    assert_same_bits(state, states[version])
    assert changes is not None
    assert values is prepared[-1] and set(values) == set(changes), "the version came without its prepared writes"
    for name, new in state.items():
        moved = np.flatnonzero(words(np.asarray(held[name])).reshape(-1) != words(np.asarray(new)).reshape(-1))
        assert np.isin(moved, changes.get(name, np.zeros(0, np.int64))).all(), f"{name}: a change not handed over"
    assert follower.take() is None


def test_take_never_waits_for_the_store_while_the_thread_runs(file_store):
    """Between groups the worker takes what the thread reached and samples on: a version the thread has not
    read yet is not followed by take() (that would be the pause). A worker with nothing left to sample on its
    version (take(wait=True)), or one without the thread, follows at once."""
    manifest, _, pub, policy, _ = _published(file_store, plane="int8g64", n=2)
    rec = Reconstructor(file_store, manifest.run, plane="int8g64", n_samples=8,
                        public_key=manifest.trainer_public_key)
    start, _ = rec.join()
    follower = Follower(rec, interval_s=3600)  # the thread will not poll within this test
    follower.start()
    try:
        for k, wait in ((0, True), (1, False)):
            _move_rows(policy, k)
            new = pub.publish(policy.state()).version
            assert new == start + k + 1
            if wait:
                assert follower.take() is None and rec.version == new - 1, "take() followed the pointer itself"
                version, state, *_ = follower.take(wait=True)
            else:
                follower.close()  # no thread: the worker follows on its own
                version, state, *_ = follower.take()
            assert version == new
            assert_same_bits(state, get_plane("int8g64").from_hf(policy.state()))
    finally:
        follower.close()


def test_a_failed_prepare_still_hands_the_version_over(file_store):
    """The reconstructor has moved on once a patch is applied: a bug in preparing its writes must not lose the
    version (the next patch's changes alone would leave this one's positions stale in the model)."""
    manifest, _, pub, policy, _ = _published(file_store, plane="bf16", n=2)
    rec = Reconstructor(file_store, manifest.run, plane="bf16", n_samples=8, public_key=manifest.trainer_public_key)
    start, _ = rec.join()

    def broken(state, changes):
        raise RuntimeError("a bug in prepare_patch")

    follower = Follower(rec, interval_s=3600, prepare=broken)
    _move_rows(policy, 0)
    pub.publish(policy.state())
    update = follower.take()
    assert update is not None and update.version == start + 1
    assert update.changes and update.prepared is None
