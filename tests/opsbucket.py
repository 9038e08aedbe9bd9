"""Build a run's bucket for the operator-view tests (status, gc) with the real writers: run.json through
`create_or_resume`, anchors, signed patches and the signed pointer through `trainer.publish.publisher.Publisher`,
per-version stats through `trainer.metrics`, and rollout records as encoded `RolloutRecord`s under
`worker_contract.layout` keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from weightsync_helpers import TinyPolicy

from trainer.metrics import version_stats, write_version_stats
from trainer.publish.publisher import Publisher
from worker_contract import layout, signing
from worker_contract.manifest import RunManifest, create_or_resume
from worker_contract.schema import RolloutRecord, Sample, SamplingParams, encode_record

N_SAMPLES = 8


def manifest_for(run: str, staleness: int = 3, anchor_interval: int = 4, plane: str = "bf16",
                 key=None) -> RunManifest:
    key = key or signing.generate_private_key()
    return RunManifest(
        run=run, n_samples=N_SAMPLES, plane=plane, kv_mode=None, task="arithmetic", model_id="tiny-test",
        architecture="Qwen2ForCausalLM", rope_theta=1e6, vocab_size=256, hidden_size=128, num_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tokenizer_digest="0" * 64, chat_template_digest="1" * 64,
        temperature=1.0, max_new_tokens=8, staleness=staleness, anchor_interval=anchor_interval,
        trainer_public_key=signing.public_key_b64(key),
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
    manifest: RunManifest
    key: object
    now: float
    patch_bytes: dict[int, int] = field(default_factory=dict)
    latency_s: dict[int, float] = field(default_factory=dict)
    drops_total: dict[str, int] = field(default_factory=dict)


def drops_of(version: int) -> dict[str, int]:
    """The drops the learner reports for the step that made `version` (a fixed pattern tests can sum)."""
    return {"stale": version % 3, "wrong_group_size": 1 if version % 4 == 0 else 0}


def build_run(store, run: str, *, pointer: int, anchor_interval: int, workers: dict[str, list[int]],
              staleness: int = 3, now: float | None = None, gone_s: dict[str, float] | None = None) -> Built:
    """Publish versions 1..pointer (an anchor every `anchor_interval`), a stats object per version, and one
    rollout group per entry of `workers` (worker id -> the versions its groups were sampled at), 10 s apart and
    the last 10 s before `now`, or `gone_s[worker]` seconds before it (a worker long gone)."""
    now = time.time() if now is None else now
    key = signing.generate_private_key()
    manifest = manifest_for(run, staleness=staleness, anchor_interval=anchor_interval, key=key)
    create_or_resume(store, manifest, resume=False)
    pub = Publisher(store, manifest, key, anchor_interval=anchor_interval, progress=False)
    policy = TinyPolicy()
    assert pub.publish_anchor(policy.state()).version == 1
    built = Built(run=run, pointer=pointer, anchors=[1], manifest=manifest, key=key, now=now)
    total: dict[str, int] = {}
    for v in range(2, pointer + 1):
        policy.step()
        done = pub.publish(policy.state())
        assert done.version == v
        stats = done.stats
        if "anchor" in stats["kind"]:
            built.anchors.append(v)
        delta = drops_of(v)
        total = {k: total.get(k, 0) + n for k, n in delta.items()}
        publish = {k: x for k, x in stats.items() if isinstance(x, int | float | str)}
        learner_view = {w: {"groups": len(vs), "used": len(vs) - 1, "drops": {"stale": 1}, "last_version": v,
                            "version_lag": 0} for w, vs in workers.items()}
        metrics = {"rollout/raw_reward": 0.5, "rollout/staleness_hist/0": 5.0, "rollout/staleness_hist/1": 3.0,
                   "rollout/staleness_hist/2": 0.0}
        write_version_stats(store, run, version_stats(
            version=v, step=v - 1, kind=stats["kind"], metrics=metrics, drops_total=total, drops_delta=delta,
            workers=learner_view, groups=8, publish=publish))
        built.patch_bytes[v], built.latency_s[v] = stats["patch_bytes"], stats["latency_s"]
    built.drops_total = {k: n for k, n in total.items() if n}
    for worker, versions in workers.items():
        for i, v in enumerate(versions):
            key_ = layout.rollout_key(run, v, worker, f"g{i:04d}")
            ago = (gone_s or {}).get(worker, 0.0) + 10 * (len(versions) - i)
            store.put_if_absent(key_, record(run, worker, f"g{i:04d}", v, created_at=now - ago))
    return built
