"""The worker's idle trickle: with no newer version for `idle_after_s` and `idle_after_groups` groups of the one
it holds uploaded, its trainer has likely stopped, and the worker samples one batch every `idle_every_s`
instead of flat out, until a new version comes. Against a file bucket with the tiny model of tests/test_worker.py.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from test_worker import RUN, _records, _worker, run_store, tiny_model_dir  # noqa: F401  (fixtures)
from test_worker_batch import PublishOnFirstUpload

from worker_contract.worker.loop import WorkerSettings


def test_a_worker_whose_trainer_publishes_nothing_slows_to_one_batch_an_interval(run_store, tiny_model_dir, caplog):  # noqa: F811
    store, *_ = run_store
    w = _worker(store, tiny_model_dir, max_groups=3, idle_after_s=0.01, idle_after_groups=1, idle_every_s=1.5)
    with caplog.at_level(logging.INFO):
        stats = w.run(threading.Event())
    assert stats.groups == 3 and stats.versions_seen == [1]
    made = sorted(rec.created_at for _, rec in _records(store))
    gaps = [b - a for a, b in zip(made, made[1:], strict=False)]
    assert all(g >= 1.5 for g in gaps), gaps  # the trickle's interval (from a batch's end), not sampling's pace
    said = [r.getMessage() for r in caplog.records if "has likely stopped" in r.getMessage()]
    assert len(said) == 1 and "no version newer than v1" in said[0] and "one batch every 2 s" in said[0], said


def test_a_new_version_ends_the_trickle_at_once(tmp_path, tiny_model_dir):  # noqa: F811
    from test_worker import _publish_run

    store = PublishOnFirstUpload(tmp_path / "bucket")
    _manifest, pub, model = _publish_run(store, tiny_model_dir)

    def publish_v2():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert pub.publish(model.state_dict()).version == 2

    store.publish = publish_v2  # v2 lands with the first group: the worker is then idle at v1, for 30 s
    w = _worker(store, tiny_model_dir, max_groups=2, idle_after_s=0.01, idle_after_groups=1, idle_every_s=30)
    w.store = store
    t0 = time.monotonic()
    stats = w.run(threading.Event())
    assert stats.versions_seen == [1, 2] and sorted(r.policy_version for _, r in _records(store)) == [1, 2]
    assert time.monotonic() - t0 < 20  # v2 ended the trickle: its group did not wait out the 30 s


def test_the_trickle_starts_after_its_time_at_one_version_and_a_newer_version_ends_it(run_store, tiny_model_dir):  # noqa: F811
    store, *_ = run_store
    w = _worker(store, tiny_model_dir, idle_after_s=60, idle_after_groups=1, idle_every_s=300)
    w._took(1)
    w._per_version = {1: 5, 2: 5}
    assert not w._idle()  # v1 has been held for under 60 s
    w._version_at -= 120
    assert w._idle()  # 2 minutes at v1 with its groups uploaded: the trickle holds the next batch back
    w._took(2)
    assert not w._idle()  # v2's clock starts now, though 5 of its groups are uploaded
    lagging = _worker(store, tiny_model_dir, idle_after_s=60, idle_after_groups=1, lag_versions=2)
    lagging._took(1)
    lagging._per_version, lagging._version_at = {1: 5}, lagging._version_at - 120
    assert not lagging._idle()  # a worker that lags on purpose never trickles


def test_the_trickle_is_on_by_default_and_off_at_zero():
    s = WorkerSettings(store="file:///tmp/b", run=RUN)
    assert (s.idle_after_s, s.idle_after_groups, s.idle_every_s) == (900.0, 64, 300.0)
    assert WorkerSettings(store="file:///tmp/b", run=RUN, idle_after_s=0).idle_after_s == 0


def test_idle_after_from_the_command_line():
    from worker_contract.worker.__main__ import parse_args

    base = ["--store", "file:///tmp/b", "--run", RUN]
    assert parse_args(base).idle_after is None  # the settings' default (900 s)
    assert parse_args([*base, "--idle-after", "0"]).idle_after == 0.0
