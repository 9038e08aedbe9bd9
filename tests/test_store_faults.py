"""Store faults: the loop runs through a fault-injecting proxy in front of a real S3 server (moto on
loopback) that answers 503 or 429, resets connections, loses answers and stalls past the client's read
timeout, on 20% of requests. A worker follows the pointer and uploads groups, the rollout source reads
them, a tiny model takes real learner steps, the publisher publishes every version; meanwhile a reader
polls the bucket directly. Afterwards every version verifies from its anchors, the weights the bucket holds
are bit-for-bit the learner's, and the reader never saw a partial object or a pointer it could not follow.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest
import torch
from invariants import BucketWatcher, verify_all
from learner_fixtures import make_record, manifest, recipe, save_tiny_model
from soakstats import record, soak_trials

from bench.faultproxy import KINDS, FaultProxy
from trainer.backends import get_backend
from trainer.objectives import policy_loss
from trainer.publish.pointer import PublishError
from trainer.publish.publisher import Publisher
from trainer.rollouts.source import RolloutSource
from trainer.step import collate
from worker_contract import layout
from worker_contract.manifest import create_or_resume
from worker_contract.planes import get_plane
from worker_contract.reconstruct import Reconstructor
from worker_contract.schema import encode_record
from worker_contract.signing import generate_private_key
from worker_contract.store import PreconditionFailed, StoreError
from worker_contract.store.s3 import MIN_PART_SIZE, S3Store

torch.set_num_threads(1)
RATE = 0.2  # well above the 10% promised, so a short run's random draw stays above it
SLOW_S = 1.5  # the proxy holds a "slow" answer this long; the client gives up after READ_TIMEOUT_S
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def stores(moto_server, proxy: FaultProxy, **kw) -> tuple[S3Store, S3Store]:
    """(a store through the proxy, a store straight to the server) on a fresh bucket."""
    bucket = moto_server.new_bucket()
    faulty = S3Store.from_url(f"s3://{bucket}", moto_server.env(endpoint=proxy.url), read_timeout=READ_TIMEOUT_S,
                              connect_timeout=READ_TIMEOUT_S, **kw)
    return faulty, S3Store.from_url(f"s3://{bucket}", moto_server.env())


def retried(fn, *args, attempts: int = 6, failures: Counter | None = None):
    """Call until it succeeds: what the learner and workers do when a store call fails after botocore's own
    retries (rare at these rates). Failures are counted by type."""
    for i in range(attempts):
        try:
            return fn(*args)
        except (StoreError, PublishError) as e:
            if isinstance(e, PreconditionFailed):
                raise
            if failures is not None:
                failures[type(e).__name__] += 1
            if i == attempts - 1:
                raise
            time.sleep(0.05)


def upload(store, rec, failures: Counter) -> None:
    key = layout.rollout_key(rec.run, rec.policy_version, rec.worker_id, rec.group_id)
    try:
        retried(store.put_if_absent, key, encode_record(rec), failures=failures)
    except PreconditionFailed:
        failures["create_only_already_landed"] += 1  # an earlier attempt landed; its answer was lost


def fault_figures(proxy: FaultProxy) -> dict:
    reqs = proxy.requests()
    faults = Counter(r.fault for r in reqs if r.fault)
    return {"requests": len(reqs), "faults": sum(faults.values()), "fault_rate": sum(faults.values()) / len(reqs),
            "by_kind": dict(sorted(faults.items()))}


def faulty_run(moto_server, model_dir, seed: int, steps: int) -> dict:
    """One run through the faults; returns its figures (and asserts everything it promises)."""
    with FaultProxy(moto_server.endpoint, rate=RATE, kinds=KINDS, seed=seed, slow_s=SLOW_S) as proxy:
        proxy.inject(KINDS)  # every kind at least once (the first requests), then at random
        faulty, direct = stores(moto_server, proxy)
        run, key = f"faults-{seed}", generate_private_key()
        failures: Counter = Counter()
        # resume=True: a retry after a lost answer finds its own run.json (same contract) and goes on
        man = retried(lambda: create_or_resume(faulty, manifest(run, key), resume=True), failures=failures)
        cfg = recipe()
        backend = get_backend("hf").load(model_dir, cfg, device="cpu")
        pub = Publisher(faulty, man, key, anchor_interval=3, progress=False)
        source = RolloutSource.from_manifest(faulty, man, cfg.algo)
        worker = Reconstructor(faulty, run, plane="bf16", n_samples=man.n_samples)
        rng = random.Random(seed)
        versions = []
        with BucketWatcher(direct, run, man.trainer_public_key) as watcher:
            versions.append(retried(pub.publish_anchor, backend.state_dict_hf(), failures=failures).version)
            for step in range(steps):
                held = retried(worker.follow, failures=failures)  # None when the pointer has not moved
                v = held[0] if held else worker.version
                for w in ("w1", "w2"):
                    upload(faulty, make_record(run, v, w, f"s{step}", rng), failures)
                batch = source.next_batch(versions[-1], timeout_s=60, poll_interval_s=0.05)
                assert batch is not None, f"step {step}: no batch through the faults ({dict(source.drops)})"
                tb = collate([g.record for g in batch.groups])
                tb.ref_logp = backend.logprobs(tb, reference=True)
                backend.train_step(tb, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp,
                                                                  mb.advantages, mb.loss_mask, cfg.algo))
                versions.append(retried(pub.publish, backend.state_dict_hf(), failures=failures).version)
            time.sleep(0.3)  # one more look after the last publish
        figures = fault_figures(proxy)
    assert figures["fault_rate"] >= 0.10, figures
    assert {"503", "429", "reset", "slow"} <= set(figures["by_kind"]), figures
    assert versions == sorted(set(versions)), f"a version was reused or went back: {versions}"
    assert watcher.problems(direct) == [], watcher.problems(direct)
    assert watcher.seen.pointers and watcher.seen.followed, "the reader saw nothing: the check did not run"
    ok, lines = verify_all(direct, run)
    assert ok, "\n".join(lines)
    # the bucket's newest version is exactly the learner's weights, reconstructed from anchors and patches
    got_version, state = Reconstructor(direct, run, plane="bf16").join()
    assert got_version == versions[-1]
    mine = get_plane("bf16").from_hf(backend.state_dict_hf())
    dense = get_plane("bf16").to_dense(state)
    assert all(np.array_equal(dense[k].view(np.uint16), mine[k].view(np.uint16)) for k in mine)
    assert source.accepted >= 2 * steps and not source.drops, dict(source.drops)
    return {**figures, "versions": len(versions), "learner_steps": steps, "client_failures": dict(failures),
            "reader_reads": watcher.seen.reads, "pointer_reads": len(watcher.seen.pointers)}


@pytest.mark.integration
def test_learning_loop_through_store_faults_stays_correct(moto_server, model_dir):
    figures = faulty_run(moto_server, model_dir, seed=7, steps=4)
    print(figures)


def test_multipart_anchor_through_faults_is_never_seen_half_done(moto_server):
    """A 12 MB anchor goes up in 5 MB parts through the faults; the reader never sees it before it is whole,
    and patches on top of it verify."""
    with FaultProxy(moto_server.endpoint, rate=RATE, kinds=KINDS, seed=3, slow_s=SLOW_S) as proxy:
        faulty, direct = stores(moto_server, proxy, part_size=MIN_PART_SIZE)
        key = generate_private_key()
        man = retried(lambda: create_or_resume(faulty, manifest("multipart", key), resume=True))
        g = torch.Generator().manual_seed(0)
        state = {"model.embed_tokens.weight": torch.randn(2048, 1536, generator=g),
                 "model.norm.weight": torch.ones(1536)}
        pub = Publisher(faulty, man, key, anchor_interval=2, progress=False)
        versions = []
        with BucketWatcher(direct, "multipart", man.trainer_public_key, interval_s=0.005) as watcher:
            versions.append(retried(pub.publish_anchor, state).version)
            for _ in range(3):
                state["model.embed_tokens.weight"][torch.randint(0, 2048, (50,), generator=g)] += 0.5
                versions.append(retried(pub.publish, state).version)
            time.sleep(0.2)
        figures = fault_figures(proxy)
        parts = len(proxy.requests("PUT", "partNumber="))
    shards = [o for o in direct.list(layout.anchors_prefix("multipart")) if o.key.endswith(".safetensors")]
    assert len(shards) == 2 and all(o.etag.endswith("-2") for o in shards), shards  # v1 and v3, two parts each
    assert parts >= 4, parts
    assert figures["fault_rate"] >= 0.10 and versions == sorted(set(versions)), (figures, versions)
    assert watcher.problems(direct) == [], watcher.problems(direct)
    ok, lines = verify_all(direct, "multipart")
    assert ok, "\n".join(lines)


@pytest.mark.soak
def test_soak_store_faults(moto_server, model_dir):
    trials = max(2, soak_trials(20) // 5)  # a fifth of the crash trials, 6 learner steps each
    runs = [faulty_run(moto_server, model_dir, seed=100 + t, steps=6) for t in range(trials)]
    kinds: Counter = Counter()
    for r in runs:
        kinds.update(r["by_kind"])
    record("store_faults", {
        "trials": trials, "requests": sum(r["requests"] for r in runs), "faults": sum(r["faults"] for r in runs),
        "fault_rate": round(sum(r["faults"] for r in runs) / sum(r["requests"] for r in runs), 3),
        "by_kind": dict(sorted(kinds.items())), "versions_published": sum(r["versions"] for r in runs),
        "learner_steps": sum(r["learner_steps"] for r in runs), "verify_failures": 0,
        "partial_objects_seen": 0, "reader_reads": sum(r["reader_reads"] for r in runs)})


def test_the_reader_catches_partial_objects_and_a_pointer_moving_back(file_store):
    """The checks above can fail: a writer that shows a half-written object first, and a pointer written
    backwards, are both reported."""
    from worker_contract.pointer import make_pointer

    key = generate_private_key()
    man = create_or_resume(file_store, manifest("bad-writer", key), resume=False)
    obj = layout.rollout_key("bad-writer", 1, "w", "g")
    with BucketWatcher(file_store, "bad-writer", man.trainer_public_key, interval_s=0.005) as watcher:
        file_store.put(obj, b"half of it")
        time.sleep(0.3)
        file_store.put(obj, b"half of it, then the rest")  # what an object store never shows a reader
        for v, digest in ((3, "0" * 64), (2, "0" * 64), (3, "1" * 64)):  # back, then v3 naming other weights
            file_store.put(layout.pointer_key("bad-writer"), make_pointer("bad-writer", v, 1, digest, key).to_bytes())
            time.sleep(0.3)
    found = "\n".join(watcher.problems(file_store))
    assert f"{obj}: a reader saw content other than the final object" in found
    assert "pointer moved back from v3 to v2" in found and "could not follow the pointer" in found
    assert "v3 was named with 2 different states" in found
