"""Publishing off the learner's critical path (trainer/publish/queue.py): learner steps go on while the
bucket is stuck in an upload; the newest state wins when publishing falls behind; versions stay
consecutive, the pointer moves last, and the stats objects add up. The store is a real file bucket whose
uploads of patches wait on a gate the test opens (a store that is slow exactly as long as the test says)."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch
from learner_fixtures import make_record, manifest, recipe, save_tiny_model, tiny_model

from trainer import step
from trainer.backends import get_backend
from trainer.rollouts.audit import WorkerAudit
from trainer.session import LearnerSession
from worker_contract import layout
from worker_contract.manifest import create_or_resume
from worker_contract.planes import get_plane
from worker_contract.pointer import read_pointer
from worker_contract.reconstruct import Reconstructor
from worker_contract.signing import generate_private_key
from worker_contract.store import StoreError
from worker_contract.store.file import FileStore

torch.set_num_threads(1)
RUN = "pq"


class GatedStore(FileStore):
    """A file bucket whose patch uploads wait until `gate` is set (and can be told to fail instead)."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # set while an upload is held at the gate
        self.fail = False

    def put_if_absent(self, key, data):
        if "/versions/" in key:
            if self.fail:
                raise StoreError(f"{key}: the bucket refused the upload")
            self.waiting.set()
            assert self.gate.wait(60), "the test never opened the gate"
            self.waiting.clear()
        return super().put_if_absent(key, data)


@pytest.fixture
def run(tmp_path):
    store = GatedStore(tmp_path / "bucket")
    key = generate_private_key()
    man = create_or_resume(store, manifest(RUN, key), resume=False)
    cfg = recipe(anchor_interval=100)
    backend = get_backend("hf").load(save_tiny_model(tmp_path / "tiny"), cfg)
    session = LearnerSession(cfg, store, man, key, progress=False)  # the queue as both engines wire it
    yield store, man, cfg, backend, session.publishing
    store.gate.set()
    session.publishing.close(timeout_s=60)


def _report(n: int, groups: int, drops: int) -> step.StepReport:
    return step.StepReport(step=n, metrics={"train/loss": float(n)}, drops_total={"malformed": drops}, workers={},
                           groups=groups)


def _steps(cfg, backend, queue, first: int, count: int):
    """`count` learner steps through the spine, each handing its weights to the queue; their blocking times."""
    rng, base, audit = random.Random(first), tiny_model(seed=0), WorkerAudit()
    blocking = []
    for n in range(first, first + count):
        records = [make_record(RUN, 1, "w", f"g{n}-{i}", rng, model=base) for i in range(cfg.algo.groups_per_step)]
        step.train_on(backend, records, cfg.algo, audit, None)
        blocking.append(queue.submit(backend.publish_snapshot(), n, _report(n, len(records), drops=n)))
    return blocking


def test_steps_go_on_while_the_bucket_is_stuck_and_the_newest_state_wins(run):
    store, man, cfg, backend, queue = run
    first = queue.publish_now(backend.publish_snapshot(), 0, _report(0, 0, drops=0), anchor=True)
    assert first.version == 1

    store.gate.clear()  # from here every patch upload hangs until the gate opens
    _steps(cfg, backend, queue, 1, 1)
    assert store.waiting.wait(60)  # step 1's patch is inside its upload
    blocking = _steps(cfg, backend, queue, 2, 2)  # two more steps run meanwhile
    pointer, _ = read_pointer(store, RUN, man.trainer_public_key)
    assert pointer.version == 1 and not queue.idle()  # nothing visible yet: the pointer moves last
    assert queue.skipped_states == 1  # step 2's weights were replaced by step 3's while waiting
    assert all(b >= 0 for b in blocking)

    store.gate.set()
    assert queue.flush(timeout_s=120)
    pointer, _ = read_pointer(store, RUN, man.trainer_public_key)
    assert pointer.version == queue.current == 3  # v2 = step 1, v3 = step 3: no version number skipped
    assert [p.step for p in queue.collect()] == [0, 1, 3] and queue.failures == 0

    version, state = Reconstructor(store, RUN, plane="bf16", n_samples=man.n_samples).join()
    assert version == 3  # a worker joining now gets exactly the learner's newest weights
    dense = get_plane("bf16").to_dense(state)
    live = backend.state_dict_hf()
    for name, arr in dense.items():
        want = live[name].to(torch.bfloat16).view(torch.uint16).numpy()
        assert np.array_equal(np.asarray(arr).view(np.uint16), want), name

    stats = {v: json.loads(store.get(layout.stats_key(RUN, v))) for v in (1, 2, 3)}
    assert [stats[v]["step"] for v in (1, 2, 3)] == [0, 1, 3]
    assert stats[3]["groups"] == 2 * cfg.algo.groups_per_step  # the replaced step's groups are reported here
    assert stats[3]["drops"] == {"malformed": 2} and stats[3]["drops_total"] == {"malformed": 3}


def test_a_failed_publish_is_counted_and_the_next_one_lands(run):
    store, man, cfg, backend, queue = run
    queue.publish_now(backend.publish_snapshot(), 0, _report(0, 0, drops=0), anchor=True)
    store.fail = True
    _steps(cfg, backend, queue, 1, 1)
    assert queue.flush(timeout_s=120) and queue.failures == 1 and queue.current == 1
    store.fail = False
    _steps(cfg, backend, queue, 2, 1)
    assert queue.flush(timeout_s=120) and queue.failures == 1
    pointer, _ = read_pointer(store, RUN, man.trainer_public_key)
    assert pointer.version == queue.current == 2  # the failed attempt's version was free again
    metrics = step.publish_metrics(queue, 0.01)
    assert metrics["publish/failures"] == 1.0 and metrics["publish/blocking_s"] == 0.01
    assert metrics["publish/version"] == 2.0 and metrics["publish/patch_bytes"] > 0


def test_the_audit_holds_the_weights_to_the_version_that_holds_them(tmp_path):
    """A step's publish that finishes while the next step waits for its batch: the audit of that step
    compares with the version just published, not the one the session saw last."""
    store = FileStore(tmp_path / "bucket")
    key = generate_private_key()
    man = create_or_resume(store, manifest(RUN, key), resume=False)
    cfg = recipe(anchor_interval=100)
    backend = get_backend("hf").load(save_tiny_model(tmp_path / "tiny"), cfg)
    session = LearnerSession(cfg, store, man, key, progress=False)
    counts = step.SourceCounts(metrics={}, drops={}, workers={})
    try:
        assert session.publish_start(backend.publish_snapshot(), counts) == 1
        assert session.weights_version() == 1  # step 0: the anchor holds the weights
        _steps(cfg, backend, session.publishing, 1, 1)
        session.step = 1
        assert session.publishing.flush(timeout_s=60) and session.current == 1  # not yet taken
        assert session.weights_version() == 2  # step 1's weights are v2's
        assert session.weights_version(0) is None  # step 0's are no longer what the learner holds
    finally:
        session.close()
