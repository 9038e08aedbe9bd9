"""The hf backend on a tiny Qwen2: log-probs equal a plain transformers forward; steps lower the loss."""

from __future__ import annotations

import json
import math
import random
import socket
from pathlib import Path

import psutil
import pytest
import torch
from learner_fixtures import make_record, manifest, put_record, recipe, save_tiny_model, tiny_model

from trainer.backends import get_backend
from trainer.backends.base import token_logprobs
from trainer.objectives import policy_loss
from trainer.step import collate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def fixed_batch(model=None, groups: int = 3, seed: int = 0):
    rng = random.Random(seed)
    return collate([make_record("r", 1, "w", f"g{i}", rng, model=model) for i in range(groups)])


def plain_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """Per-token log-probs straight from transformers: logits / T, log_softmax, gather."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.zeros(batch.loss_mask.shape)
    for i in range(batch.rows):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        tokens = batch.input_ids[i, p : p + r]
        out[i, :r] = logp[i, p - 1 : p + r - 1].gather(1, tokens[:, None])[:, 0]
    return out


def test_registry_refuses_unknown_backends():
    with pytest.raises(ValueError, match="known: hf, megatron"):
        get_backend("jax")
    assert get_backend("hf").name == "hf"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_learner_logprobs_equal_a_plain_transformers_forward(model_dir, temperature):
    cfg = recipe(micro_batch_size=5, vocab_chunk=10)  # uneven micro-batches and vocab chunks
    cfg.algo.temperature = temperature
    backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    batch = fixed_batch(groups=3)
    assert batch.rows == 12 and len(set(batch.prompt_lens.tolist())) > 1  # ragged prompts and responses
    ours = backend.logprobs(batch)
    ref = plain_logprobs(tiny_model(seed=0), batch, temperature)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    assert torch.equal(backend.logprobs(batch, reference=True), ours)  # before training, ref == policy
    assert (ours[batch.loss_mask == 0] <= 0).all() and ours.abs().sum() > 0


def test_chunked_logprobs_match_full_softmax_values_and_gradients():
    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(23, 5, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 23, (7,))
    ours = token_logprobs(h, w, tgt, 0.8, chunk_size=6)
    full = torch.log_softmax((h.float() @ w.float().t()) / 0.8, -1).gather(1, tgt[:, None])[:, 0]
    assert torch.allclose(ours, full, atol=1e-5)
    g_ours = torch.autograd.grad(ours.sum(), (h, w))
    g_full = torch.autograd.grad(full.sum(), (h, w))
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(g_ours, g_full, strict=True))


def test_bf16_output_layer_gives_the_same_logprobs_and_trains(model_dir):
    """The GPU path of the output layer (bf16 operands, float32 logits, token chunks), run on the CPU."""
    cfg = recipe(micro_batch_size=5)
    f32 = get_backend("hf").load(model_dir, cfg, device="cpu")
    bf16 = get_backend("hf").load(model_dir, cfg, device="cpu", compute_dtype=torch.bfloat16)
    batch = fixed_batch(tiny_model(seed=0), groups=2)
    a, b = f32.logprobs(batch), bf16.logprobs(batch)
    assert 0 < (a - b).abs().max() < 0.05  # a different computation, the same model to bf16 rounding
    batch.ref_logp = bf16.logprobs(batch, reference=True)
    head = bf16.model.get_output_embeddings().weight
    before = head.detach().clone()
    m = bf16.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                          mb.loss_mask, cfg.algo))
    assert head.dtype == torch.float32 and not torch.equal(head, before)  # gradient reached the fp32 weight
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0


def test_learner_steps_lower_the_loss_on_a_fixed_batch(model_dir):
    cfg = recipe(micro_batch_size=4)
    backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    batch = fixed_batch(tiny_model(seed=0), groups=2)  # behaviour log-probs from the starting policy
    batch.ref_logp = backend.logprobs(batch, reference=True)

    def loss_fn(logp, mb):
        return policy_loss(logp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, cfg.algo)

    first = backend.train_step(batch, loss_fn)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy start: ratio 1 everywhere
    losses = [first["loss"]] + [backend.train_step(batch, loss_fn)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    assert first["grad_norm"] > 0 and "gate_drop_frac" in first and "clip_high_frac" in first


def test_token_budget_micro_batches_are_consecutive_and_bounded():
    batch = fixed_batch(groups=3)
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    for rows, tokens in ((5, None), (100, 40), (3, 40), (100, 1)):
        parts = batch.micro_batches(rows, tokens)
        assert sum(p.rows for p in parts) == batch.rows
        start = 0
        for p in parts:
            got = (p.prompt_lens + p.response_lens).tolist()
            assert got == lengths[start : start + p.rows]  # consecutive rows, in order
            assert p.rows <= rows and p.input_ids.shape[1] == max(got)  # trimmed to its longest row
            assert tokens is None or p.rows == 1 or p.rows * max(got) <= tokens
            start += p.rows
    assert [p.rows for p in batch.micro_batches(100, 1)] == [1] * batch.rows  # a row over budget goes alone
    assert len(batch.micro_batches(100, 40)) > len(batch.micro_batches(100, 10**6)) == 1


def test_micro_batch_size_does_not_change_the_step(model_dir):
    batch = fixed_batch(tiny_model(seed=0), groups=2)
    grads = []
    for mbs in (8, 3, "tokens"):
        cfg = recipe(micro_batch_size=mbs if mbs != "tokens" else 1)
        if mbs == "tokens":
            cfg.compute.max_tokens_per_gpu = 2 * int((batch.prompt_lens + batch.response_lens).max())
        backend = get_backend("hf").load(model_dir, cfg, device="cpu")
        batch.ref_logp = backend.logprobs(batch, reference=True)
        m = backend.train_step(batch, lambda lp, mb, c=cfg: policy_loss(
            lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, c.algo))
        grads.append((m["loss"], m["grad_norm"], backend.state_dict_hf()["model.norm.weight"]))
    for other in grads[1:]:
        assert grads[0][0] == pytest.approx(other[0], rel=1e-5)
        assert grads[0][1] == pytest.approx(other[1], rel=1e-4)
        assert torch.allclose(grads[0][2], other[2], atol=1e-6)


def test_state_dict_hf_has_the_names_save_pretrained_writes(model_dir, tmp_path):
    from safetensors import safe_open

    cfg = recipe()
    cfg.model.dtype = "bfloat16"
    backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    state = backend.state_dict_hf()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(state) == set(f.keys())
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in state.values())
    assert backend.model.model.norm.weight.dtype == torch.float32  # master weights stay fp32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners(procs) -> set[tuple[str, int]]:
    out = set()
    for p in procs:
        try:
            out |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet") if c.status == "LISTEN"}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@pytest.mark.integration
def test_learner_loop_on_ray_trains_publishes_and_reports(model_dir, tmp_path, monkeypatch, caplog):
    """The whole loop once (Ray start costs seconds and about a GB, so one test covers it): steps run,
    versions are published and visible, metrics and stats land, the dashboard and every other Ray
    listener are on loopback only, nothing is written to the home directory, no Ray process outlives it."""
    from trainer.metrics import read_metrics
    from trainer.native.learner import run_learner
    from trainer.publish.publisher import Publisher
    from worker_contract import layout
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import generate_private_key
    from worker_contract.store.file import FileStore

    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DRL_RAY_DASHBOARD", "1")
    monkeypatch.setenv("DRL_RAY_DASHBOARD_PORT", str(port))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    store = FileStore(tmp_path / "bucket")
    key = generate_private_key()
    man = create_or_resume(store, manifest("e2e", key), resume=False)
    base, rng = tiny_model(seed=0), random.Random(1)
    for v in range(1, 8):
        for w in ("w1", "w2"):
            put_record(store, make_record("e2e", v, w, f"g{v}", rng, model=base))
    store.put_if_absent(layout.rollout_key("e2e", 1, "evil", "g0"), b"garbage")  # never stops the learner

    seen = []

    def on_step(m):  # every process Ray started for us, and what each listens on
        seen.append((m, _listeners(psutil.Process().children(recursive=True))))

    cfg = recipe(num_steps=3)
    result = run_learner(cfg, store, man, key, model_dir, tmp_path / "run", on_step=on_step, batch_wait_s=1.0,
                         torch_threads=1)

    assert [m["step"] for m, _ in seen] == [1, 2, 3] and result.step == 3
    assert result.first_version == 1 and result.version == 4  # anchor v1, then one version per step
    assert Publisher(store, man, key, anchor_interval=3).current_version() == 4
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/drops/malformed"] == 1 and rows[-1]["worker/evil/dropped"] == 1
    assert all(math.isfinite(r["train/loss"]) and len(r["rollout/groups"]) == 2 for r in rows)
    assert {"train/gate_drop_frac", "train/ratio_max", "rollout/raw_reward", "rollout/staleness_hist/0",
            "worker/w1/version_lag", "publish/bytes", "publish/latency_s"} <= set(rows[-1])
    stats = {v: json.loads(store.get(layout.stats_key("e2e", v))) for v in range(1, 5)}
    assert stats[1]["kind"] == "anchor" and stats[4]["step"] == 3 and stats[4]["publish"]["patch_bytes"] > 0
    assert sum(stats[v]["drops"].get("malformed", 0) for v in stats) == 1  # deltas add up to the total
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-0000000002",
                                                                                     "step-0000000003"]

    listeners = set().union(*(ls for _, ls in seen))
    assert ("127.0.0.1", port) in listeners and len(listeners) > 3  # the dashboard, GCS, raylet, agents
    assert {ip for ip, _ in listeners} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listeners  # loopback only
    assert list(home.iterdir()) == []  # no ~/.ray/auth_token, nothing else either
    assert not [p for p in psutil.Process().children(recursive=True) if "ray" in p.name().lower()]

    # the newest checkpoint cut short (a full disk): the next session resumes from the previous one, says so
    model_pt = tmp_path / "run" / "checkpoints" / "step-0000000003" / "model.pt"
    with open(model_pt, "r+b") as f:
        f.truncate(model_pt.stat().st_size // 3)
    with caplog.at_level("WARNING", logger="trainer.native.learner"):
        again = run_learner(recipe(num_steps=4), store, man, key, model_dir, tmp_path / "run", batch_wait_s=1.0,
                            torch_threads=1)
    assert "step-0000000003 is damaged (model.pt is" in caplog.text and "falling back" in caplog.text
    assert again.step == 4 and again.first_version == 5 and again.resumed_from.endswith("step-0000000002")


def test_stores_reach_actors_by_pickle_or_by_url(s3_store, moto_server, tmp_path):
    """A file store travels as itself; an S3 store (its client does not pickle) as its URL plus only the
    store variables of the environment, and reopens to the same bucket."""
    from trainer.ray_runtime import open_store_spec, ray_tmpdir, store_spec
    from worker_contract.store.file import FileStore

    kind, value = store_spec(FileStore(tmp_path / "b"))
    assert kind == "pickle"
    env = {**moto_server.env(), "HOME": "/root", "UNRELATED": "x"}
    kind, (url, sent) = store_spec(s3_store, env)
    assert kind == "url" and url == s3_store.url and set(sent) == set(moto_server.env())
    s3_store.put("r/x", b"hello")
    assert open_store_spec((kind, (url, sent))).get("r/x") == b"hello"
    # Ray's sockets need a short temp dir: the run dir's own when it fits, else a short one in /tmp
    assert ray_tmpdir("/tmp/run") == (Path("/tmp/run/ray/r"), False)
    long_dir, fallback = ray_tmpdir("/tmp/" + "d" * 80)
    assert fallback and len(str(long_dir)) < 40 and ray_tmpdir("/tmp/" + "d" * 80)[0] == long_dir
