"""The fleet's one learner: a stand-in for the GPU step around the real rollout source and publisher.

It creates the run (run.json, the v1 anchor), then loops like trainer/native/learner.py does: the source polls
in a background thread (`run_poller`), the learner takes a batch (`next_batch`), spends `step_s` as its
GPU would, changes `change_frac` of its small model's weights and hands the state to a publishing thread
(trainer/session.py's LearnerSession: the newest state replaces one still waiting, as in the learner). Every poll is timed,
every use of a group is logged with its upload-to-use latency, and the process's RSS is sampled. When the
fleet stops, a final drain polls until nothing new comes, so every group inside the window was read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainer.config import AlgoConfig
from trainer.rollouts.source import RolloutSource
from trainer.step import note_batch, source_counts
from worker_contract import layout
from worker_contract.manifest import RunManifest, create_or_resume
from worker_contract.signing import generate_private_key, public_key_b64
from worker_contract.store import ObjectInfo, Store
from worker_contract.store.s3 import S3Store

from .spec import FleetSpec
from .wire import BUCKET, LEARNER_KEY, store_env

log = logging.getLogger("bench.fleet.learner")


class ReadLog(Store):
    """The learner's store, noting which rollout records it read whole (a wrapper, not a stand-in: every
    call goes to the real S3 client)."""

    def __init__(self, inner: Store):
        self.inner, self.url = inner, inner.url
        self.read: set[str] = set()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        if "/rollouts/" in key:
            with self._lock:
                self.read.add(key)
        return data

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return self.inner.get_with_etag(key)

    def head(self, key: str):
        return self.inner.head(key)

    def put(self, key: str, data: bytes) -> str:
        return self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        return self.inner.put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        return self.inner.put_if_match(key, data, etag)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def upload_file(self, key: str, path: str | Path, *, if_absent: bool = False) -> str:
        return self.inner.upload_file(key, path, if_absent=if_absent)

    def download_file(self, key: str, path: str | Path) -> None:
        self.inner.download_file(key, path)

    def open_read(self, key: str) -> BinaryIO:
        return self.inner.open_read(key)


class TimedSource(RolloutSource):
    """The real rollout source; each poll's wall time, listings and new groups are recorded."""

    polls: list

    def poll(self, current: int) -> int:
        t0, lists = time.monotonic(), self.list_calls
        added = super().poll(current)
        self.polls.append((time.time(), time.monotonic() - t0, self.list_calls - lists, added))
        return added


def manifest_for(spec: FleetSpec, run: str, key) -> RunManifest:
    return RunManifest(run=run, n_samples=spec.n_samples, plane="bf16", task="gsm8k", model_id="fleet-sim",
                       architecture="Qwen2ForCausalLM", rope_theta=1e6, vocab_size=spec.vocab_size, hidden_size=256,
                       num_layers=spec.tensors, num_attention_heads=4, num_key_value_heads=2,
                       tokenizer_digest="0" * 64, chat_template_digest="0" * 64, temperature=1.0,
                       max_new_tokens=spec.max_new_tokens, staleness=spec.staleness,
                       anchor_interval=spec.anchor_interval, trainer_public_key=public_key_b64(key))


def _session(spec: FleetSpec, store: Store, man: RunManifest, key, algo: AlgoConfig, publishes: list[dict]):
    """The learner's train side as the native learner builds it (trainer/session.py: publisher, publish queue,
    version stats), each finished publish also logged with its wall time for the fleet's figures."""
    from trainer.config import RecipeConfig, TrainConfig
    from trainer.session import LearnerSession

    cfg = RecipeConfig(name="fleet", task="gsm8k", run=man.run, algo=algo,
                       train=TrainConfig(anchor_interval=spec.anchor_interval))
    session = LearnerSession(cfg, store, man, key, progress=False)
    # with a real fleet's sizes the small anchor is cut into as many shards as the real one (bf16: 2 bytes a weight)
    plane_bytes = spec.tensors * spec.tensor_shape[0] * spec.tensor_shape[1] * 2
    session.publisher.shard_bytes = -(-plane_bytes // spec.anchor_shards) if spec.anchor_bytes else None
    write = session.publishing.on_published

    def on_published(result, report) -> None:
        publishes.append({"version": result.version, "t": time.time(), "s": result.stats.get("latency_s"),
                          "kind": result.stats.get("kind"), "bytes": result.stats.get("bytes")})
        if write is not None:
            write(result, report)

    session.publishing.on_published = on_published
    return session


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def learner_process(spec: FleetSpec, run: str, endpoint: str, stop_event, ready, out_queue) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.ERROR)
    store = ReadLog(S3Store.from_url(f"s3://{BUCKET}", store_env(endpoint, LEARNER_KEY)))
    key = generate_private_key()
    man = create_or_resume(store, manifest_for(spec, run, key), resume=False)
    rng = np.random.default_rng(spec.seed)
    state = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal(spec.tensor_shape, dtype=np.float32) * 0.02
             for i in range(spec.tensors)}
    algo = AlgoConfig(staleness=spec.staleness, reuse_cap=spec.reuse_cap, groups_per_step=spec.batch,
                      max_new_tokens=spec.max_new_tokens, temperature=1.0)
    source = TimedSource.from_manifest(store, man, algo, **spec.source_options)
    source.polls = []
    journal: list[tuple[str, str]] = []
    source.tally.on_drop = lambda key, reason: journal.append((key, reason))
    publishes: list[dict] = []
    session = _session(spec, store, man, key, algo, publishes)
    session.publish_start(state, source_counts(source))
    publishes.clear()  # the start's anchor is the first version, not a publish of the loop
    stop = threading.Event()
    poller = threading.Thread(target=source.run_poller, args=(stop, spec.poll_interval_s), daemon=True)
    source.poll(session.current)  # names the version, so the background poller starts
    poller.start()
    rss: list[tuple[float, float]] = [(time.time(), _rss_mb())]
    uses: list[tuple] = []
    steps: list[dict] = []
    ready.set()
    last_rss = time.monotonic()
    while not stop_event.is_set():
        current = session.take_published()
        t0 = time.monotonic()
        batch = source.next_batch(current, timeout_s=2.0, poll_interval_s=spec.poll_interval_s)
        if time.monotonic() - last_rss >= 1.0:
            rss.append((time.time(), _rss_mb()))
            last_rss = time.monotonic()
        if batch is None:
            continue
        now = time.time()
        uses.extend((g.key, g.use, now - g.record.created_at, g.lag) for g in batch.groups)
        time.sleep(spec.step_s)  # the GPU's part of the step
        for name in state:
            a = state[name]
            idx = rng.integers(0, a.size, int(a.size * spec.change_frac))
            a.flat[idx] += rng.standard_normal(idx.size, dtype=np.float32) * 0.002
        session.step += 1
        session.hand_off({k: v.copy() for k, v in state.items()}, session.report(note_batch(batch, source)))
        steps.append({"t": now, "wait_s": time.monotonic() - t0 - spec.step_s, "version": current,
                      "groups": len(batch.groups)})
    stop.set()
    poller.join(timeout=60)
    session.close()
    drain = _drain(source, session.current)
    rss.append((time.time(), _rss_mb()))
    out_queue.put(("learner", {
        "uses": uses, "steps": steps, "polls": source.polls, "publishes": publishes,
        "publish_failures": session.publishing.failures, "rss": rss, "read": sorted(store.read),
        "drops": dict(source.drops), "accepted": source.accepted, "metrics": source.metrics(),
        "worker_stats": source.worker_stats(), "journal": journal,
        "current": session.current, "window": list(source.window(session.current)), "drain": drain,
        "public_key": man.trainer_public_key, "forged_reclaimed": session.publisher.forged_pointer_reclaimed,
    }))


def _drain(source: RolloutSource, current: int) -> dict:
    """Poll until two polls in a row find nothing new (a poll that meets a flaky store finds nothing either,
    so retry a few times); every group inside the window is then read."""
    t0, polls, quiet = time.monotonic(), 0, 0
    while (quiet < 3 or polls <= source.sweep_every) and polls < 60:  # a sweep sees keys behind start_after
        polls += 1
        quiet = quiet + 1 if source.poll(current) == 0 else 0
    return {"polls": polls, "s": time.monotonic() - t0}


def rollout_keys(store: Store, run: str) -> list[ObjectInfo]:
    return list(store.list(layout.rollouts_prefix(run)))
