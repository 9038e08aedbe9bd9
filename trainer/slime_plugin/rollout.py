"""`--rollout-function-path trainer.slime_plugin.rollout.generate_rollout`: the bucket feeds slime.

slime calls `generate_rollout(args, rollout_id, data_source, evaluation=False)` in its RolloutManager
actor once per step (docs/slime.md). We ignore slime's data source: the prompts were
chosen and sampled by the workers. The bucket rollout source (trainer/rollouts/source.py) validates every record,
drops what is stale (beyond the staleness bound, counted from the signed pointer) and caps reuse; we
convert its batch into exactly `rollout_batch_size` contiguous groups of `n_samples_per_prompt` Samples,
the only layout slime's rollout-side reward normalisation reshapes per group.
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .context import PluginContext, check_args, context
from .types import slime_types

log = logging.getLogger(__name__)
#: how long one wait for a full batch lasts before the wait is logged and renewed
WAIT_LOG_S = 60.0


def group_to_samples(group, *, group_index: int, first_index: int, Sample, routes=None) -> list:
    """One validated group (trainer.rollouts.pool.Group) as n_samples slime Samples, in the record's order;
    `routes` = (route shape, the model's layer count) when slime replays the records' routes."""
    rec = group.record
    out = []
    replay = None if routes is None else slime_routes(rec, *routes)
    for i, s in enumerate(rec.samples):
        status = Sample.Status.TRUNCATED if s.finish_reason in ("length", "abort") else Sample.Status.COMPLETED
        out.append(Sample(
            group_index=group_index, index=first_index + i, prompt="", label=rec.prompt_id,
            tokens=list(rec.prompt_ids) + list(s.response_ids), response="", response_length=len(s.response_ids),
            reward=float(s.reward), loss_mask=list(s.loss_mask), rollout_log_probs=list(s.behavior_logprobs),
            weight_versions=[str(rec.policy_version)], status=status,
            metadata={"raw_reward": float(s.reward), "policy_version": rec.policy_version, "worker_id": rec.worker_id,
                      "group_id": rec.group_id, "prompt_id": rec.prompt_id, "use": group.use, "lag": group.lag,
                      "finish_reason": s.finish_reason},
        ))
        if replay is not None:
            out[-1].rollout_routed_experts = replay[i]
    return out


def slime_routes(rec, shape, num_layers: int) -> list:
    """Each sample's routes as slime's rollout routing replay takes them: int32 [len(tokens) - 1, num_layers,
    top_k] over every layer (the dense ones' rows are never read). Tokens the record has no routes for (the
    last trained token and any tool tokens after it) predict nothing trained on: they get experts 0..k-1."""
    import numpy as np

    from worker_contract.routes import decode_routes

    prompt, samples = decode_routes(rec, shape)
    out = []
    for s, resp in zip(rec.samples, samples, strict=True):
        n = len(rec.prompt_ids) + len(s.response_ids) - 1
        a = np.tile(np.arange(shape.top_k, dtype=np.int32), (n, num_layers, 1))
        routed = np.concatenate([prompt, resp]).astype(np.int32)
        a[:len(routed), list(shape.moe_layers)] = routed
        out.append(a)
    return out


def next_batch(ctx: PluginContext, *, timeout_s: float | None = None, model_dir: str | None = None):
    """Block until the rollout side has a full batch for the current version: (batch, its note), or None
    only after `timeout_s`."""
    side = ctx.rollouts(model_dir)
    start = time.monotonic()
    while True:
        current = ctx.current_version()
        wait = WAIT_LOG_S if timeout_s is None else max(0.0, min(WAIT_LOG_S, timeout_s - (time.monotonic() - start)))
        got = side.next_batch(current, wait)
        if got is not None:
            return got
        if timeout_s is not None and time.monotonic() - start >= timeout_s:
            return None
        m = side.source.metrics()
        log.info("waiting for rollouts at v%d: %d usable groups pooled, %d needed; %d dropped so far",
                 current, int(m["rollout/pool"]), ctx.cfg.algo.groups_per_step, int(m["rollout/dropped"]))


def train_output(args: Any, rollout_id: int, ctx: PluginContext, *, timeout_s: float | None = None):
    Sample, TrainOutput, _, _ = slime_types()
    model_dir = getattr(args, "hf_checkpoint", None)
    got = next_batch(ctx, timeout_s=timeout_s, model_dir=model_dir)
    if got is None:
        raise TimeoutError(f"no full batch of {ctx.cfg.algo.groups_per_step} groups within {timeout_s} s")
    batch, note = got
    n = ctx.manifest.n_samples
    shape = ctx.rollouts().source.rules.routes
    routes = (shape, int(args.num_layers)) if ctx.cfg.algo.routing_replay and shape is not None else None
    groups = [group_to_samples(g, group_index=gi, first_index=gi * n, Sample=Sample, routes=routes)
              for gi, g in enumerate(batch.groups)]
    assert all(len(g) == n for g in groups), "the rollout source let a wrong-sized group through"
    # worker/* repeat the counts' per-worker figures: slime's log and the stats object leave them out
    note.counts.metrics = {k: v for k, v in note.counts.metrics.items() if not k.startswith("worker/")}
    ctx.hand_over(rollout_id, note)  # who sampled what and the counts, for the audit and the stats object
    metrics = {**note.metrics, **note.counts.metrics, "rollout/learner_version": float(note.current_version)}
    return TrainOutput(samples=groups, metrics=metrics)


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime's rollout function: a training batch from the bucket, or the held-out eval (evaluation=True)."""
    ctx = context()
    check_args(args, ctx.manifest, ctx.cfg)
    if evaluation:
        from .evaluate import eval_output

        return eval_output(args, rollout_id, ctx)
    return train_output(args, rollout_id, ctx)
