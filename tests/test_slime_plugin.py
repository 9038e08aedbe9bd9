"""trainer/slime_plugin against the argument and Sample shapes slime uses (docs/slime.md), with a real
file bucket: run.json and the v1 anchor published by the launch's own step, real worker records, and a
stand-in SGLang `/generate` server on 127.0.0.1 for the held-out eval.

slime is not installed here, so the plugin uses its local twins of slime's types; the checks below are
the ones slime's own plugin contract test makes (slime's plugin_contracts tests), plus ours.
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
import threading
import time
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from embedded.config import EmbeddedBaseConfig
from infra.anchor import publish_base_anchor
from infra.launch_gpu import step_write_recipe
from infra.slime_launch import BoxPaths
from trainer import algo
from trainer.config import resolve
from trainer.slime_plugin import context as plugin_context
from trainer.slime_plugin import objective, publish
from trainer.slime_plugin.rollout import generate_rollout, train_output
from trainer.slime_plugin.types import slime_types
from worker_contract import layout
from worker_contract.pointer import read_pointer
from worker_contract.reconstruct import Reconstructor
from worker_contract.schema import RolloutRecord, Sample, SamplingParams, encode_record
from worker_contract.store import open_store
from worker_contract.tasks import get_task

torch.set_num_threads(1)
RUN = "plugin-test"
N, G, MAX_NEW = 4, 2, 8
SlimeSample, TrainOut, EvalOut, FROM_SLIME = slime_types()


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """A tiny HF model dir, a file bucket with run.json + v1 published by infra.anchor, the recipe file."""
    from embedded.basemodel import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("box")
    task = get_task("arithmetic")
    texts = [p.question + "\n" + (p.solution or p.answer) for p in task.dataset("train")[:200]]
    tok = build_tokenizer(texts, vocab_size=300)
    model = build_model(tok, EmbeddedBaseConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                intermediate_size=64))
    hf = root / "hf"
    model.save_pretrained(str(hf))
    tok.save_pretrained(str(hf))
    bucket = f"file://{root / 'bucket'}"
    cfg = resolve("gsm8k", env={"DRL_RUN": RUN}).model_copy(deep=True)
    cfg.task, cfg.store = "arithmetic", bucket
    cfg.model.hf_id, cfg.model.path = None, str(hf)
    cfg.contract.n_samples = N
    cfg.algo.groups_per_step, cfg.algo.max_new_tokens, cfg.algo.reuse_cap = G, MAX_NEW, 2
    cfg.train.anchor_interval, cfg.train.poll_interval_s = 3, 0.01
    cfg.embedded["eval_problems"] = 6
    paths = BoxPaths(remote_dir=str(root / "dRL"), run=RUN, model_dir_override=str(hf))
    first = publish_base_anchor(cfg, paths, env={}, progress=False)
    again = publish_base_anchor(cfg, paths, env={}, progress=False)
    step_write_recipe(cfg, paths)
    return {"cfg": cfg, "paths": paths, "tok": tok, "model": model, "hf": hf, "store": open_store(bucket, {}),
            "first": first, "again": again, "task": task}


@pytest.fixture
def plugin(box, monkeypatch, tmp_path):
    """The plugin's environment as the launch sets it (fresh state dir per test), context reset around it."""
    paths = box["paths"]
    state = tmp_path / "state"
    state.mkdir()
    shutil.copyfile(paths.key_file, state / "trainer.key")  # the key publish_base_anchor created
    (state / "trainer.key").chmod(0o600)
    monkeypatch.setenv("DRL_RECIPE_FILE", paths.recipe_file)
    monkeypatch.setenv("DRL_STATE_DIR", str(state))
    monkeypatch.setenv("DRL_ENV_FILE", str(tmp_path / "no-such.r2env"))
    plugin_context.reset_context()
    yield state
    plugin_context.reset_context()


def put_group(box, group: str, *, version: int = 1, n: int = N, plane: str = "bf16", seed: int = 0) -> str:
    rec = _record(box, group, version=version, n=n, plane=plane, seed=seed)
    key = layout.rollout_key(RUN, version, "w1", group)
    box["store"].put_if_absent(key, encode_record(rec))
    return key


def _record(box, group: str, *, version: int = 1, n: int = N, plane: str = "bf16", seed: int = 0) -> RolloutRecord:
    rng = random.Random(f"{group}-{seed}")
    vocab = len(box["tok"])
    prompt = [rng.randrange(3, vocab) for _ in range(5)]
    samples = []
    for i in range(n):
        resp = [rng.randrange(3, vocab) for _ in range(rng.randint(2, MAX_NEW))]
        mask = [1] * len(resp)
        blp = [-rng.uniform(0.1, 4.0) for _ in resp]
        if i == 1:
            mask[0], blp[0] = 0, 0.0  # a tool token
        samples.append(Sample(response_ids=resp, behavior_logprobs=blp, loss_mask=mask, reward=float(i % 2),
                              finish_reason="length" if i == 2 else "stop"))
    rec = RolloutRecord(run=RUN, worker_id="w1", group_id=group, policy_version=version, plane=plane,
                        task="arithmetic", prompt_id=f"p-{group}", prompt_ids=prompt,
                        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW),
                        samples=samples, created_at=time.time())
    return rec


def slime_args(**over):
    base = dict(n_samples_per_prompt=N, rollout_batch_size=G, rollout_temperature=1.0, reward_key=None)
    return Namespace(**{**base, **over})


def assert_slime_sample(s):
    """The checks of slime's plugin contract test, plus the fields the learner needs."""
    assert isinstance(s, SlimeSample)
    assert isinstance(s.tokens, list) and all(isinstance(t, int) for t in s.tokens)
    assert isinstance(s.response, str) and isinstance(s.response_length, int)
    assert s.reward is not None and isinstance(s.status, SlimeSample.Status)


def test_base_anchor_published_once(box):
    assert box["first"].startswith("v1 anchor")
    assert "base already published" in box["again"]
    pointer, _ = read_pointer(box["store"], RUN, None)
    assert pointer.version == 1


def test_signature_is_slimes():
    sig = inspect.signature(generate_rollout)
    assert tuple(sig.parameters) == ("args", "rollout_id", "data_source", "evaluation")
    assert sig.parameters["evaluation"].default is False


def test_train_batch_has_slimes_shape(box, plugin):
    keys = [put_group(box, f"g{i}") for i in range(G)]
    put_group(box, "short", n=N - 1)         # wrong group size: dropped and counted
    put_group(box, "plane", plane="int8g64")  # wrong plane: dropped and counted
    out = generate_rollout(slime_args(), 0, None, evaluation=False)
    assert isinstance(out, TrainOut)
    assert len(out.samples) == G and all(len(g) == N for g in out.samples)
    seen = set()
    for gi, group in enumerate(out.samples):
        gids = {s.metadata["group_id"] for s in group}
        assert len(gids) == 1  # contiguous: a group is one record
        seen |= gids
        rec = box["store"].get(layout.rollout_key(RUN, 1, "w1", gids.pop()))
        from worker_contract.schema import decode_record

        rec = decode_record(rec)
        for s, ws in zip(group, rec.samples, strict=True):
            assert_slime_sample(s)
            assert s.tokens == rec.prompt_ids + ws.response_ids
            assert s.response_length == len(ws.response_ids) == len(s.loss_mask) == len(s.rollout_log_probs)
            assert s.loss_mask == ws.loss_mask and s.rollout_log_probs == ws.behavior_logprobs
            assert s.reward == ws.reward and s.group_index == gi
            want = SlimeSample.Status.TRUNCATED if ws.finish_reason == "length" else SlimeSample.Status.COMPLETED
            assert s.status == want and s.weight_versions == ["1"]
    assert seen == {k.rsplit("/", 1)[1].removesuffix(".json.zst") for k in keys}
    assert out.metrics["rollout/drops/group_size"] == 1 and out.metrics["rollout/drops/wrong_plane"] == 1
    assert out.metrics["rollout/learner_version"] == 1.0
    handed = json.loads((plugin / "handoff.json").read_text())  # the one file slime's processes share
    assert sorted(handed["ledger"]["uses"]) == sorted(keys)
    assert handed["batches"]["0"]["groups"] == [["w1", 1]] * G


def test_slimes_contract_call_with_args_none(box, plugin):
    """slime's own contract test passes args=None and a stub data source."""
    for i in range(G):
        put_group(box, f"c{i}", seed=1)
    out = generate_rollout(None, 2, object(), evaluation=False)
    assert len(out.samples) == G and all(len(g) == N for g in out.samples)


def test_slime_flags_that_disagree_with_the_run_are_refused(box, plugin):
    with pytest.raises(ValueError, match="--n-samples-per-prompt 8 differs from run.json n_samples"):
        generate_rollout(slime_args(n_samples_per_prompt=8), 0, None)
    with pytest.raises(ValueError, match="--rollout-temperature 0.7"):
        generate_rollout(slime_args(rollout_temperature=0.7), 0, None)


def test_reuse_cap_holds_across_a_restart(box, plugin):
    for i in range(G):
        put_group(box, f"r{i}", seed=2)
    ctx = plugin_context.context()
    uses: dict[str, list[int]] = {}
    for k in range(50):  # the module's bucket also holds earlier tests' groups: drain them all
        try:
            out = train_output(slime_args(), k, ctx, timeout_s=0.5)
        except TimeoutError:
            break
        for g in out.samples:
            uses.setdefault(g[0].metadata["group_id"], []).append(g[0].metadata["use"])
    assert {"r0", "r1"} <= set(uses)
    assert all(u == [1, 2] for u in uses.values()), uses  # each group exactly twice (reuse cap 2)
    plugin_context.reset_context()  # a restarted RolloutManager: the ledger comes back from the state dir
    with pytest.raises(TimeoutError):
        train_output(slime_args(), 3, plugin_context.context(), timeout_s=0.3)


def test_a_hand_off_of_another_version_is_refused_in_one_sentence(box, plugin):
    """slime's processes share one hand-off file; one written by another plugin version is not guessed at."""
    from trainer.slime_plugin.handoff import HandoffError

    (plugin / "handoff.json").write_text(json.dumps({"handoff_version": 2, "ledger": {}, "batches": {}}))
    with pytest.raises(HandoffError) as refused:
        generate_rollout(slime_args(), 0, None)
    said = str(refused.value)
    assert "handoff.json is hand-off version 2, this plugin reads 1" in said and "\n" not in said
    (plugin / "handoff.json").write_text("{not json")
    with pytest.raises(HandoffError, match="does not read as a hand-off"):
        plugin_context.reset_context() or generate_rollout(slime_args(), 0, None)


def test_each_version_reports_the_batch_its_weights_trained_on(box, plugin):
    """slime's driver prepares the next rollout while the actor trains: the after-train hook of rollout k
    reports rollout k's batch, not the newest one the rollout side took."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(box["hf"]), torch_dtype=torch.bfloat16)
    for i in range(G):
        put_group(box, f"first{i}", seed=6)
    first = train_output(slime_args(), 7, plugin_context.context(), timeout_s=5)
    for i in range(3 * G):  # more groups land before the next rollout is prepared
        put_group(box, f"zz-later{i}", seed=7)  # keys after every other: listed at once
    ahead = train_output(slime_args(), 8, plugin_context.context(), timeout_s=5)
    assert ahead.metrics["rollout/accepted"] > first.metrics["rollout/accepted"]
    version = publish.after_train(slime_args(), 7, [model])
    stats = json.loads(box["store"].get(layout.stats_key(RUN, version)))
    assert stats["step"] == 8 and stats["groups"] == G
    assert stats["metrics"]["rollout/accepted"] == first.metrics["rollout/accepted"]


# -- objective ------------------------------------------------------------------------------------------
def _flat_samples(rewards):
    return [SlimeSample(reward=r, tokens=[1], response_length=1) for r in rewards]


def test_drgrpo_rewards_use_group_means(box, plugin):
    raw = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    got_raw, adv = objective.drgrpo_rewards(slime_args(), _flat_samples(raw))
    assert got_raw == raw
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    with pytest.raises(ValueError, match="groups of --n-samples-per-prompt 4"):
        objective.drgrpo_rewards(slime_args(), _flat_samples(raw[:6]))


def _slime_like_batch(seed=0, rows=6):
    """Per-sample tensors as slime's policy loss holds them (flat, concatenated over samples)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 9, (rows,), generator=g)]
    logp = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lengths]
    mu = [lp + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1.5 for lp, n in zip(logp, lengths, strict=True)]
    adv = [torch.full((n,), float(torch.randn((), generator=g)), dtype=torch.float64) for n in lengths]
    adv[0].zero_()
    masks = [(torch.rand(n, generator=g) > 0.2).to(torch.float64) for n in lengths]
    return lengths, logp, mu, adv, masks


def test_dppo_gate_equals_the_learners_gate(box, plugin):
    gate = box["cfg"].algo.gate
    a = box["cfg"].algo
    lengths, logp, mu, adv, masks = _slime_like_batch()
    flat = torch.cat(logp).requires_grad_(True)
    ratio = algo.ratio_from_logp(flat, torch.cat(mu))
    pg = algo.dual_clip_loss(ratio, torch.cat(adv), a.eps_clip, a.eps_clip_high, a.eps_clip_c)
    gated, new_masks, metrics = objective.dppo_gate(slime_args(), pg_loss=pg, train_log_probs=logp,
                                                    rollout_log_probs=mu, loss_masks=masks,
                                                    total_lengths=lengths, response_lengths=lengths)
    keep = algo.dppo_keep_mask(torch.cat(logp), torch.cat(mu), torch.cat(adv), gate.delta_low, gate.delta_high,
                               gate.divergence)
    assert 0 < int((~keep).sum()) < keep.numel()  # the batch exercises both outcomes
    assert torch.equal(gated.detach(), pg.detach() * keep)
    assert torch.equal(torch.cat(new_masks), torch.cat(masks) * keep)
    assert [m.numel() for m in new_masks] == lengths
    assert torch.equal(metrics["dppo_drop_frac"], (~keep).double())
    gated.sum().backward()
    assert torch.all(flat.grad[~keep] == 0) and torch.any(flat.grad[keep] != 0)


# -- the two engines optimise one objective ---------------------------------------------------------------
def _slime_policy_loss(args, mb: list[int], logp, mu, ref, adv, masks, mask_sums):
    """slime's `policy_loss_function` for the flags the slime engine passes (docs/slime.md,
    slime 624b824a `backends/megatron_utils/loss.py`), on one micro-batch of samples `mb`: the ratio to
    the rollout log-probs (--use-rollout-logprobs), dual-clip PPO (`ppo_utils.compute_policy_loss`), our
    TIS hook (--get-mismatch-metrics --custom-tis-function-path), `sum_of_sample_mean` rebuilt with the
    hook's masks over `rollout_mask_sums`, our pg reducer, the k3 KL (--kl-loss-type low_var_kl,
    `compute_approx_kl`: float32, clamped to [-10, 10]) reduced by that `sum_of_sample_mean`."""
    lp = torch.cat([logp[i] for i in mb])
    old = torch.cat([mu[i] for i in mb])
    a = torch.cat([adv[i] for i in mb])
    ppo_kl = old - lp
    ratio = (-ppo_kl).exp()
    pg1, pg2 = -ratio * a, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * a
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(a < 0, torch.minimum(-args.eps_clip_c * a, clip1), clip1)
    lengths = [int(logp[i].numel()) for i in mb]
    pg, new_masks, _ = objective.dppo_gate(args, pg_loss=pg, train_log_probs=[logp[i].detach() for i in mb],
                                           rollout_log_probs=[mu[i] for i in mb], loss_masks=[masks[i] for i in mb],
                                           total_lengths=lengths, response_lengths=lengths)

    def sum_of_sample_mean(x):
        return sum((xi * m).sum() / max(float(d), 1.0)
                   for xi, m, d in zip(x.split(lengths), new_masks, [mask_sums[i] for i in mb], strict=True))

    pg_loss = objective.drgrpo_reducer(lengths, lengths, new_masks, False)(pg)
    log_ratio = -(lp.float() - torch.cat([ref[i] for i in mb]).float())
    kl = (log_ratio.exp() - 1 - log_ratio).clamp(-10, 10)
    return pg_loss + args.kl_loss_coef * sum_of_sample_mean(kl)


def test_engines_agree_on_loss_and_gradient(box, plugin):
    """One batch of worker records through both engines: the native step (collate, `step.loss_fn` on the
    backend's micro-batches, each weighted by its share of rows) and the slime hooks (the rollout function's
    Samples, the reward hook's advantages, slime's loss arithmetic on other micro-batches, scaled by
    num_microbatches / global_batch_size and divided by num_microbatches as Megatron does). The policy is
    a free log-prob per response token, so the gradient compared is d loss / d logp, token by token."""
    from trainer import step
    from trainer.rollouts.source import Group
    from trainer.slime_plugin.rollout import group_to_samples
    from trainer.step import collate

    ctx = plugin_context.context()
    ctx.cfg = ctx.cfg.model_copy(update={"algo": ctx.cfg.algo.model_copy(update={"kl_coef": 0.5})})
    a = ctx.cfg.algo
    records = [_record(box, f"agree-{i}", seed=i) for i in range(3)]
    rng = torch.Generator().manual_seed(7)
    tb = collate(records)
    rows, width = tb.rows, tb.max_response
    noise = (torch.rand((rows, width), generator=rng) - 0.5) * 2.4
    target = (tb.behavior_logp + noise).clamp(max=-1e-3)  # the current policy's log-probs
    ref_all = (tb.behavior_logp + (torch.rand((rows, width), generator=rng) - 0.5)).clamp(max=-1e-3)
    tb.ref_logp = ref_all

    # native: the backend's micro-batches of 3 rows, each loss weighted by mb.rows / rows
    theta = (target - tb.behavior_logp).clone().requires_grad_(True)
    loss_of = step.loss_fn(a)
    native = 0.0
    for start in range(0, rows, 3):
        mb = tb.select(start, min(start + 3, rows))
        logp = mb.behavior_logp + theta[start:start + mb.rows, :mb.max_response]
        loss, metrics = loss_of(logp, mb)
        part = loss * (mb.rows / rows)
        part.backward()
        native += float(part.detach())
    native_grad = theta.grad.clone()
    assert 0 < metrics["gate_drop_frac"] and metrics["kl_loss"] > 0  # the batch exercises gate and KL

    # slime: the same records as the rollout function's Samples, advantages from the reward hook
    samples = [s for gi, r in enumerate(records)
               for s in group_to_samples(Group(f"k{gi}", r, 1, 0), group_index=gi, first_index=gi * N,
                                         Sample=SlimeSample)]
    _, adv_flat = objective.drgrpo_rewards(slime_args(), samples)
    lens = [s.response_length for s in samples]
    theta_s = (target - tb.behavior_logp).clone().requires_grad_(True)
    mu = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    logp_s = [mu[i] + theta_s[i, :n] for i, n in enumerate(lens)]
    ref = [ref_all[i, :n] for i, n in enumerate(lens)]
    adv = [torch.full((n,), adv_flat[i]) for i, n in enumerate(lens)]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    mask_sums = [sum(s.loss_mask) for s in samples]  # rollout_mask_sums: each sample is its own rollout
    args = slime_args(eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c,
                      kl_loss_coef=a.kl_coef)
    micro = [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10, 11]]
    global_batch, num_mb = len(samples), len(micro)
    theirs = 0.0
    for mb in micro:
        loss = _slime_policy_loss(args, mb, logp_s, mu, ref, adv, masks, mask_sums)
        part = loss * num_mb / global_batch / num_mb
        part.backward()
        theirs += float(part.detach())
    assert theirs == pytest.approx(native, rel=1e-5)
    torch.testing.assert_close(theta_s.grad, native_grad, rtol=1e-5, atol=1e-8)
    assert torch.count_nonzero(native_grad) > 0


def test_drgrpo_reducer_constant_denominator(box, plugin):
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])]
    x = torch.arange(8, dtype=torch.float64, requires_grad=True)
    out = objective.drgrpo_reducer([10, 12], [3, 5], masks, False)(x)
    assert float(out.detach()) == pytest.approx((0 + 1 + 3 + 4 + 5 + 6 + 7) / MAX_NEW)
    out.backward()
    assert x.grad.tolist() == [1 / MAX_NEW, 1 / MAX_NEW, 0.0] + [1 / MAX_NEW] * 5
    with pytest.raises(ValueError, match="calculate-per-token-loss"):
        objective.drgrpo_reducer([10], [3], masks[:1], True)


# -- publishing -----------------------------------------------------------------------------------------
def test_after_train_publishes_each_new_policy(box, plugin):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(box["hf"]), torch_dtype=torch.bfloat16)
    ctx = plugin_context.context()
    start = ctx.current_version()
    versions, kinds = [], []
    for step in range(2):
        with torch.no_grad():
            for p in list(model.parameters())[:3]:
                p.add_(0.01 * (step + 1))
        versions.append(publish.after_train(slime_args(), step, [model]))
        kinds.append(ctx.session().publisher.last_stats["kind"])
    assert versions == [start + 1, start + 2]
    assert kinds[0] == "anchor" and kinds[1] in ("patch", "patch+anchor")  # a fresh process anchors first
    pointer, _ = read_pointer(box["store"], RUN, ctx.manifest.trainer_public_key)
    assert pointer.version == versions[-1]
    stats = json.loads(box["store"].get(layout.stats_key(RUN, versions[-1])))
    assert stats["version"] == versions[-1] and stats["publish"]["kind"] == kinds[1]

    rec = Reconstructor(box["store"], RUN, plane="bf16", n_samples=N)  # a worker joining now
    version, state = rec.join()
    assert version == versions[-1]
    from worker_contract.planes import get_plane

    dense = get_plane("bf16").to_dense(state)
    sd = model.state_dict()
    for name, arr in dense.items():
        assert np.array_equal(np.asarray(arr).view(np.uint16), sd[name].view(torch.uint16).numpy()), name


def _megatron_save(root, iteration: int, *, complete: bool = True) -> None:
    """What Megatron's save_checkpoint leaves: iter_<7 digits>/ with files, then the tracker when complete."""
    d = root / f"iter_{iteration:07d}" / "__0_0.distcp"
    d.parent.mkdir(parents=True)
    d.write_bytes(b"x" * 64)
    if complete:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_after_train_keeps_the_recipes_number_of_slime_checkpoints(box, plugin, tmp_path):
    """slime's --save gets one checkpoint per --save-interval and Megatron deletes none (about 22 GB each
    for the quickstart, 116 GB for psqa); the hook keeps train.keep_checkpoints complete ones, never the
    newest, never a save that has not completed."""
    from transformers import AutoModelForCausalLM

    keep = plugin_context.context().cfg.train.keep_checkpoints
    assert keep == 2
    model = AutoModelForCausalLM.from_pretrained(str(box["hf"]), torch_dtype=torch.bfloat16)
    save = tmp_path / "ckpt"
    for it in range(4):
        _megatron_save(save, it)
    _megatron_save(save, 4, complete=False)  # a save cut short: newer than the tracker
    args = slime_args(save=str(save), num_rollout=100)
    publish.after_train(args, 4, [model])
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000003", "iter_0000004",
                                                      "latest_checkpointed_iteration.txt"]
    shutil.rmtree(save / "iter_0000004")
    _megatron_save(save, 4)  # slime saves rollout 4 after the hook
    publish.after_train(args, 5, [model])
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]
    publish.after_train(slime_args(num_rollout=100), 6, [model])  # no --save: nothing to prune
    publish.after_train(args, 99, [model])  # the last rollout waits for its publish
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]


def _model_logprobs(model, tokens: list[int], response_length: int) -> torch.Tensor:
    """The policy's log-prob of each response token (temperature 1), as slime's recompute gives them."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    start = len(tokens) - response_length
    return logp[start - 1 : len(tokens) - 1].gather(1, torch.tensor(tokens[start:])[:, None])[:, 0]


def test_worker_audit_runs_in_the_slime_engine(box, plugin):
    """The rollout side records who sampled each group; slime's log-prob recompute (here: the model's own
    forward) reaches the post-process hook; the same WorkerAudit as the native learner scores each worker,
    and the next version's stats object carries its figures under the native learner's names."""
    from transformers import AutoModelForCausalLM

    from trainer.slime_plugin import audit as plugin_audit

    model = AutoModelForCausalLM.from_pretrained(str(box["hf"]), torch_dtype=torch.bfloat16)
    ctx = plugin_context.context()
    rid = 40
    version = publish.after_train(slime_args(), rid - 1, [model])  # the weights the actor trains rollout 40 from
    assert plugin_audit.weights_version(ctx, rid) == version
    for worker, shift in (("honest", 0.0), ("edits", -0.7)):
        rec = _record(box, f"audit-{worker}", version=version, seed=5)
        samples = []
        for s in rec.samples:
            lp = _model_logprobs(model, list(rec.prompt_ids) + list(s.response_ids), len(s.response_ids))
            samples.append(s.model_copy(update={"behavior_logprobs": [min(float(x) + shift, 0.0) for x in lp]}))
        rec = rec.model_copy(update={"worker_id": worker, "samples": samples})
        box["store"].put_if_absent(layout.rollout_key(RUN, version, worker, rec.group_id), encode_record(rec))

    out = train_output(slime_args(), rid, ctx, timeout_s=10)
    flat = [s for g in out.samples for s in g]
    assert {s.metadata["worker_id"] for s in flat} == {"honest", "edits"}
    rollout_data = {  # what slime's actor holds when it calls the hook (one DP rank: every sample)
        "sample_indices": [s.index for s in flat],
        "log_probs": [_model_logprobs(model, s.tokens, s.response_length) for s in flat],
        "rollout_log_probs": [torch.tensor(s.rollout_log_probs) for s in flat],
        "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in flat],
    }
    assert plugin_audit.audit_rollout_data(slime_args(), rid, rollout_data) == 2
    figures = ctx.session().audit.stats()
    assert figures["honest"]["logprob_mismatch"] < 1e-3
    assert figures["edits"]["logprob_mismatch"] > 0.3 and figures["edits"]["audited_tokens"] > 0

    after = publish.after_train(slime_args(), rid, [model])
    stats = json.loads(box["store"].get(layout.stats_key(RUN, after)))
    assert stats["workers"]["edits"]["logprob_mismatch"] == pytest.approx(figures["edits"]["logprob_mismatch"])
    assert stats["workers"]["honest"]["used"] == 1 and "audit/flagged_workers" in stats["metrics"]
    # the actor's weights moved past that version: the next rollout's groups are not compared with them
    assert plugin_audit.weights_version(ctx, rid) is None
    assert plugin_audit.audit_rollout_data(slime_args(), rid, rollout_data) == 0


# -- held-out eval --------------------------------------------------------------------------------------
class _SGLangStandIn(BaseHTTPRequestHandler):
    """A stand-in SGLang `/generate`: answers even-numbered problems right, odd ones wrong, and cuts every
    third answer at the length budget. It reads the question back with the test's tokenizer."""

    answers: dict[str, tuple[int, str]] = {}
    tok = None

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text_in = self.tok.decode(body["input_ids"])
        idx, gold = next(v for q, v in self.answers.items() if q in text_in)
        text = f"Let me think.\n#### {gold if idx % 2 == 0 else int(gold) + 1}"
        finish = "length" if idx % 3 == 0 else "stop"
        out = json.dumps({"text": text, "output_ids": self.tok.encode(text, add_special_tokens=False),
                          "meta_info": {"finish_reason": {"type": finish}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def test_eval_call_scores_held_out_problems_with_the_task(box, plugin, monkeypatch):
    task, tok = box["task"], box["tok"]
    test = task.dataset("test")
    problems = [test[i] for i in range(box["cfg"].embedded["eval_problems"])]
    _SGLangStandIn.answers = {p.question: (i, p.answer) for i, p in enumerate(problems)}
    _SGLangStandIn.tok = tok
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLangStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("DRL_EVAL_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        out = generate_rollout(slime_args(hf_checkpoint=str(box["hf"])), 5, None, evaluation=True)
    finally:
        server.shutdown()
        server.server_close()
    assert isinstance(out, EvalOut)
    data = out.data["arithmetic"]
    assert set(data) >= {"rewards", "truncated", "samples"}
    assert len(data["rewards"]) == len(data["truncated"]) == len(data["samples"]) == len(problems)
    assert data["rewards"] == [1.0 if i % 2 == 0 else 0.0 for i in range(len(problems))]
    assert data["truncated"] == [i % 3 == 0 for i in range(len(problems))]
    for s in data["samples"]:
        assert_slime_sample(s)
        assert s.tokens[-s.response_length:] == tok.encode(s.response, add_special_tokens=False)
    assert out.metrics["eval/arithmetic/reward_mean"] == pytest.approx(sum(data["rewards"]) / len(problems))


def test_eval_without_an_endpoint_is_refused(box, plugin, monkeypatch):
    monkeypatch.delenv("DRL_EVAL_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match="DRL_EVAL_ENDPOINT"):
        generate_rollout(slime_args(hf_checkpoint=str(box["hf"])), 0, None, evaluation=True)
