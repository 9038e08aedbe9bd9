"""Build a run's bucket for the operator-view tests (status, gc): a manifest, anchors, patches, a pointer,
stats objects and rollout records, every key from `worker_contract.layout` and every record a real encoded
`RolloutRecord`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from worker_contract import layout
from worker_contract.manifest import RunManifest, create_or_resume
from worker_contract.schema import RolloutRecord, Sample, SamplingParams, encode_record
from worker_contract.signing import generate_private_key, public_key_b64

N_SAMPLES = 8


def manifest_for(run: str, staleness: int = 3, anchor_interval: int = 4, plane: str = "bf16") -> RunManifest:
    return RunManifest(
        run=run, n_samples=N_SAMPLES, plane=plane, kv_mode=None, task="arithmetic", model_id="tiny-test",
        architecture="Qwen2ForCausalLM", rope_theta=1e6, vocab_size=64, hidden_size=32, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tokenizer_digest="0" * 64, chat_template_digest="1" * 64,
        temperature=1.0, max_new_tokens=8, staleness=staleness, anchor_interval=anchor_interval,
        trainer_public_key=public_key_b64(generate_private_key()),
    )


def record(run: str, worker: str, group: str, version: int, created_at: float) -> bytes:
    samples = [Sample(response_ids=[1, 2, 3], behavior_logprobs=[-0.5, -0.25, -1.0], loss_mask=[1, 1, 1],
                      reward=float(i % 2), finish_reason="stop") for i in range(N_SAMPLES)]
    return encode_record(RolloutRecord(
        run=run, worker_id=worker, group_id=group, policy_version=version, plane="bf16", task="arithmetic",
        prompt_id=f"p-{group}", prompt_ids=[5, 6, 7], sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        samples=samples, created_at=created_at,
    ))


@dataclass
class Built:
    run: str
    pointer: int
    anchors: list[int]
    patch_bytes: dict[int, int] = field(default_factory=dict)
    rollouts: dict[str, list[int]] = field(default_factory=dict)  # worker -> versions of its groups
    drops: dict[str, int] = field(default_factory=dict)


def build_run(store, run: str, *, pointer: int, anchors: list[int], workers: dict[str, list[int]],
              staleness: int = 3, now: float | None = None, anchor_bytes: int = 3000) -> Built:
    """Publish a run up to `pointer`; `workers` maps a worker id to the versions of its groups (one each)."""
    now = time.time() if now is None else now
    create_or_resume(store, manifest_for(run, staleness=staleness), resume=False)
    built = Built(run=run, pointer=pointer, anchors=sorted(anchors))
    for v in anchors:
        store.put(layout.anchor_shard_key(run, v, 0), os.urandom(anchor_bytes))
        store.put(layout.anchor_shard_key(run, v, 1), os.urandom(anchor_bytes // 2))
        store.put(layout.anchor_manifest_key(run, v), json.dumps({"version": v}).encode())
    for v in range(2, pointer + 1):
        size = 100 + 10 * v
        store.put(layout.patch_key(run, v), os.urandom(size))
        built.patch_bytes[v] = size
        drops = {"stale": v % 3, "wrong_group_size": 1 if v == pointer else 0}
        stats = {"version": v, "groups": 8, "drops": drops,
                 "publish": {"patch_bytes": size, "latency_s": 0.5 + v / 100}}
        store.put(layout.stats_key(run, v), json.dumps(stats).encode())
        for k, n in drops.items():
            built.drops[k] = built.drops.get(k, 0) + n
    store.put(layout.pointer_key(run), json.dumps({"version": pointer, "published_at": now - 30}).encode())
    for worker, versions in workers.items():
        for i, v in enumerate(versions):
            key = layout.rollout_key(run, v, worker, f"g{i:04d}")
            store.put_if_absent(key, record(run, worker, f"g{i:04d}", v, created_at=now - 10 * (len(versions) - i)))
        built.rollouts[worker] = list(versions)
    return built
