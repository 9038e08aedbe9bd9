"""The reference worker's batches (`--batch-groups`, DRL_BATCH_GROUPS): several groups sampled in one batched
forward, all from one weights version, patches followed only between batches; the records are those a
one-group worker writes. Against a file bucket with the tiny model and helpers of tests/test_worker.py."""

from __future__ import annotations

import threading

import torch
from test_worker import (
    RUN,
    N,
    _fresh_logprobs,
    _publish_run,
    _records,
    _worker,
    tiny_model_dir,  # noqa: F401  (fixture: a tiny model with a tokenizer)
)

from worker_contract import layout
from worker_contract.store.file import FileStore


class PublishOnFirstUpload(FileStore):
    """A file bucket that publishes the next version (a real patch, through the publisher) when the first
    rollout lands: the worker still holds a batch sampled at the old version at that moment."""

    def __init__(self, root):
        super().__init__(root)
        self.publish = None

    def put_if_absent(self, key, data):
        out = super().put_if_absent(key, data)
        if "/rollouts/" in key and self.publish is not None:
            publish, self.publish = self.publish, None
            publish()
        return out


def test_batched_groups_come_from_one_version_and_match_a_fresh_forward(tmp_path, tiny_model_dir):  # noqa: F811
    """--batch-groups 3 with --groups 5 and 3 groups a version: a batch of 3 groups sampled in one forward at
    v1 (v2 is published while its records upload), then, the worker at its cap following the pointer at once,
    a batch of 2 at v2; records as a one-group worker writes them, each sample's log-probs those of a fresh
    forward of the version it names."""
    from worker_contract.reconstruct import Reconstructor

    store = PublishOnFirstUpload(tmp_path / "bucket")
    manifest, pub, model = _publish_run(store, tiny_model_dir)
    states = {1: Reconstructor(store, RUN, plane="bf16").join()[1]}

    def publish_v2():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert pub.publish(model.state_dict()).version == 2

    store.publish = publish_v2
    w = _worker(store, tiny_model_dir, max_groups=5, batch_groups=3, max_groups_per_version=3)
    w.store = store  # the worker opened its own client of this bucket from the URL; it uploads through this one
    stats = w.run(threading.Event())
    assert stats.groups == 5 and stats.versions_seen == [1, 2]
    states[2] = Reconstructor(store, RUN, plane="bf16").join()[1]
    recs = _records(store)
    assert sorted(r.policy_version for _, r in recs) == [1, 1, 1, 2, 2]  # no batch mixes versions
    for key, rec in recs:
        assert layout.parse_rollout_key(key).version == rec.policy_version
        assert len(rec.samples) == N and rec.sampling.max_new_tokens == manifest.max_new_tokens
        for s in rec.samples[:2]:
            fresh = _fresh_logprobs(tiny_model_dir, states[rec.policy_version], rec.prompt_ids, s.response_ids,
                                    manifest.temperature)
            assert torch.allclose(torch.tensor(s.behavior_logprobs), fresh, atol=1e-4), (s.behavior_logprobs, fresh)


def test_batch_groups_from_the_command_line_or_the_environment(monkeypatch):
    from worker_contract.worker.__main__ import parse_args

    base = ["--store", "file:///tmp/b", "--run", RUN]
    assert parse_args(base).batch_groups is None  # the settings' default (1)
    monkeypatch.setenv("DRL_BATCH_GROUPS", "6")
    assert parse_args(base).batch_groups == 6
    assert parse_args([*base, "--batch-groups", "2"]).batch_groups == 2
