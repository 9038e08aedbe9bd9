"""The MLX worker (`--backend mlx`, real mlx + mlx-lm on the CPU) against a file bucket with a tiny Qwen2:
it joins like the torch worker, holds the plane natively and bit for bit after every patch (the same state
the torch worker reconstructs), writes records the learner's source accepts with no drop, records
log-probs of the distribution it sampled from, refuses a tampered patch, a wrong plane and a KV mode it
does not implement. LFM2 and LFM2-MoE: the plane maps onto mlx-lm's modules and gives transformers'
log-probs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")

from tests.worker_fixtures import publish_run, save_tiny_qwen2  # noqa: E402
from worker_contract import layout  # noqa: E402
from worker_contract.manifest import ContractMismatch  # noqa: E402
from worker_contract.planes import get_plane  # noqa: E402
from worker_contract.schema import decode_record  # noqa: E402
from worker_contract.store.file import FileStore  # noqa: E402
from worker_contract.tasks import get_task  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RUN = "mlx-run"
N = 4
PLANES = ("bf16", "int8g64")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 1-layer Qwen2 whose matrices all have a last dim divisible by 64, so int8g64 quantizes them."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny64"), hidden_size=64, intermediate_size=128)


def _publish_run(store, model_dir, plane, *, kv_mode=None):
    return publish_run(store, model_dir, RUN, n_samples=N, plane=plane, kv_mode=kv_mode)


def _worker(store, model_dir, plane, *, backend="mlx", env=None, **over):
    from worker_contract.worker.loop import Worker, WorkerSettings

    settings = WorkerSettings(store=store.url, run=RUN, model_dir=str(model_dir), worker_id=f"{backend}-1", seed=0,
                              threads=1, backend=backend, **over)
    return Worker(settings, env={"DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": plane, **(env or {})})


def _bits(a) -> np.ndarray:
    """The raw bits of a numpy or mlx array (bf16 through uint16), for exact comparison."""
    if isinstance(a, mx.array):
        a = np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def _assert_mlx_holds(mlx_worker, torch_worker, plane):
    """The MLX model's parameters are the plane's tensors (mapped to mlx-lm's names), bit for bit, and the
    dense weights they stand for are the torch worker's, bit for bit."""
    from worker_contract.worker.mlx_model import flat_parameters
    from worker_contract.worker.mlx_weights import to_mlx

    pol = mlx_worker.policy
    held = flat_parameters(pol.model)
    want = to_mlx(pol.architecture, torch_worker.rec.state)
    assert set(held) == set(want)
    for name, a in want.items():
        h = held[name]
        if pol.dtype == "float32" and h.dtype == mx.float32 and a.dtype.name == "bfloat16":
            h = h.astype(mx.bfloat16)  # the upcast is exact, so casting back gives the published bits
        assert str(h.dtype).removeprefix("mlx.core.") == a.dtype.name, name
        assert np.array_equal(_bits(h), _bits(a)), name
    tparams = dict(torch_worker.policy.model.named_parameters())
    if plane == "int8g64":
        quantized = pol._quantized
        assert quantized and {"model.embed_tokens", "model.layers.0.mlp.down_proj"} <= quantized
        for mod in quantized:
            deq = mx.dequantize(held[f"{mod}.weight"], held[f"{mod}.scales"], held[f"{mod}.biases"],
                                group_size=64, bits=8).astype(mx.float32)
            assert np.array_equal(np.array(deq), tparams[f"{mod}.weight"].numpy()), mod
    else:
        for name, t in tparams.items():
            assert np.array_equal(np.array(held[name].astype(mx.float32)), t.numpy()), name


def _mlx_fresh_logprobs(policy, prompt, response, temperature):
    """Log-probs of `response` after `prompt` from one full forward (no cache) of the MLX model."""
    logits = policy.model(mx.array([prompt + response]))[0, len(prompt) - 1:-1].astype(mx.float32) / temperature
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(logp, mx.array(response)[:, None], axis=-1)[:, 0])


@pytest.mark.parametrize("plane", PLANES)
def test_joins_and_writes_records_the_learners_source_accepts(tmp_path, tiny_model_dir, plane):
    from trainer.rollouts.pool import BatchRules, RecordRules
    from trainer.rollouts.source import RolloutSource

    store = FileStore(tmp_path / "bucket")
    cfg, manifest, _, _ = _publish_run(store, tiny_model_dir, plane)
    w = _worker(store, tiny_model_dir, plane, max_groups=3)
    stats = w.run(threading.Event())
    assert stats.groups == 3 and w.version == 1 and stats.tokens > 0
    src = RolloutSource(store, RecordRules.from_manifest(manifest, cfg.algo),
                        BatchRules(groups_per_step=3, reuse_cap=2))
    assert src.poll(1) == 3
    assert sum(src.drops.values()) == 0, src.drops
    for key in store.list_keys(layout.rollouts_prefix(RUN)):
        rec = decode_record(store.get(key))
        assert rec.plane == plane and rec.worker_id == "mlx-1" and len(rec.samples) == N
        for s in rec.samples:
            fresh = _mlx_fresh_logprobs(w.policy, rec.prompt_ids, s.response_ids, manifest.temperature)
            np.testing.assert_allclose(s.behavior_logprobs, fresh, atol=2e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("plane", PLANES)
def test_follows_patches_bit_exact_with_the_torch_workers_state(tmp_path, tiny_model_dir, plane, dtype):
    store = FileStore(tmp_path / "bucket")
    _, _, pub, model = _publish_run(store, tiny_model_dir, plane)
    mw = _worker(store, tiny_model_dir, plane, mlx_dtype=dtype)
    tw = _worker(store, tiny_model_dir, plane, backend="torch")
    stop = threading.Event()
    assert mw.setup(stop) and tw.setup(stop)
    _assert_mlx_holds(mw, tw, plane)
    problem = get_task("arithmetic").dataset("train")[0]
    for v in (2, 3, 4):
        _perturb(model, v)
        assert pub.publish(model.state_dict()).version == v
        assert mw.sample_group(problem).policy_version == v - 1  # not followed mid-group: the old weights
        assert mw.sync() == v and tw.sync() == v
        _assert_mlx_holds(mw, tw, plane)
    assert mw.stats.versions_seen == [1, 2, 3, 4]


def test_a_tampered_patch_is_refused_and_the_weights_kept(tmp_path, tiny_model_dir, caplog):
    from worker_contract.worker.mlx_model import flat_parameters

    store = FileStore(tmp_path / "bucket")
    _, _, pub, model = _publish_run(store, tiny_model_dir, "int8g64")
    w = _worker(store, tiny_model_dir, "int8g64")
    assert w.setup(threading.Event())
    before = {k: _bits(v).copy() for k, v in flat_parameters(w.policy.model).items()}
    _perturb(model, 2)
    assert pub.publish(model.state_dict()).version == 2
    key = layout.patch_key(RUN, 2)
    blob = bytearray(store.get(key))
    blob[-100] ^= 0x01  # one bit of the patch body
    store.put(key, bytes(blob))
    with caplog.at_level("WARNING", logger="worker"):
        assert w.sync() == 1
    assert "not following the pointer, staying on v1" in caplog.text
    after = flat_parameters(w.policy.model)
    assert all(np.array_equal(_bits(after[k]), b) for k, b in before.items())


def test_wrong_plane_is_refused_at_join_with_exit_3(tmp_path, tiny_model_dir):
    store = FileStore(tmp_path / "bucket")
    _publish_run(store, tiny_model_dir, "bf16")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "int8g64"}
    p = subprocess.run([sys.executable, "-m", "worker_contract.worker", "--backend", "mlx", "--store", store.url,
                        "--run", RUN, "--model", str(tiny_model_dir), "--worker-id", "m", "--groups", "1"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert ("worker refuses to join: DRL_PULSE_PLANE='int8g64' but run 'mlx-run' publishes plane 'bf16'"
            in p.stderr)
    assert store.list_keys(layout.rollouts_prefix(RUN)) == []


@pytest.mark.parametrize("run_mode,env_mode,needle", [
    ("dense", None, "run 'mlx-run' requires kv_mode='dense'; the mlx worker implements paged_prefix"),
    (None, "dense", "DRL_KV_MODE asks for kv_mode='dense'; the mlx worker implements paged_prefix"),
    ("paged_prefix", "dense", "DRL_KV_MODE='dense' but run 'mlx-run' requires kv_mode='paged_prefix'"),
])
def test_a_kv_mode_it_does_not_implement_is_refused(tmp_path, tiny_model_dir, run_mode, env_mode, needle):
    store = FileStore(tmp_path / "bucket")
    _publish_run(store, tiny_model_dir, "bf16", kv_mode=run_mode)
    env = {"DRL_KV_MODE": env_mode} if env_mode else {}
    with pytest.raises(ContractMismatch) as e:
        _worker(store, tiny_model_dir, "bf16", env=env).setup(threading.Event())
    assert needle in str(e.value)


def test_paged_prefix_run_is_joined(tmp_path, tiny_model_dir):
    store = FileStore(tmp_path / "bucket")
    _publish_run(store, tiny_model_dir, "bf16", kv_mode="paged_prefix")
    w = _worker(store, tiny_model_dir, "bf16", env={"DRL_KV_MODE": "paged_prefix"}, max_groups=1)
    assert w.run(threading.Event()).groups == 1


def test_nucleus_logprobs_are_those_of_the_distribution_sampled_from():
    from worker_contract.worker.mlx_sampling import nucleus_logprobs

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    T, top_p = 0.7, 0.8
    got = np.array(nucleus_logprobs(mx.array(logits), T, top_p))
    for row, lg in zip(got, logits, strict=True):
        p = np.exp(lg / T - np.logaddexp.reduce(lg / T))
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]  # smallest prefix reaching top_p
        want = np.full_like(p, -np.inf)
        want[keep] = np.log(p[keep] / p[keep].sum())
        assert np.array_equal(np.isfinite(row), np.isfinite(want))
        np.testing.assert_allclose(row[keep], want[keep], atol=1e-5)
    assert np.allclose(np.array(nucleus_logprobs(mx.array(logits), T, 1.0)),
                       torch.log_softmax(torch.tensor(logits) / T, -1).numpy(), atol=1e-5)


def _tiny_lfm2(moe: bool):
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(3)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=128, layer_types=["conv", "full_attention", "conv"], tie_word_embeddings=True)
    if moe:
        cfg = Lfm2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, num_dense_layers=1)
        return Lfm2MoeForCausalLM(cfg).eval()
    cfg = Lfm2Config(**common, intermediate_size=128, block_auto_adjust_ff_dim=False)
    return Lfm2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("moe", [False, True], ids=["lfm2", "lfm2_moe"])
def test_lfm2_planes_load_natively_and_give_transformers_logprobs(tmp_path, plane, moe):
    """No tokenizer needed: the model is built from config.json and run on token ids."""
    from worker_contract.worker.mlx_model import build_model, flat_parameters, load_plane_into
    from worker_contract.worker.mlx_weights import to_mlx

    hf = _tiny_lfm2(moe)
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(tmp_path)
    state = get_plane(plane).from_hf({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    model, arch, _ = build_model(tmp_path)
    quantized = load_plane_into(model, arch, state, dtype="bfloat16")
    assert bool(quantized) == (plane == "int8g64")
    held, mapped = flat_parameters(model), to_mlx(arch, state)
    assert set(held) == set(mapped)
    assert all(np.array_equal(_bits(held[k]), _bits(v)) for k, v in mapped.items())
    if moe:
        assert held["model.layers.1.feed_forward.switch_mlp.gate_proj.weight"].shape[0] == 4
    # the same dense weights in transformers (float32) against MLX with float32 activations
    dense = get_plane(plane).to_dense(state)
    with torch.no_grad():
        for k, p in hf.named_parameters():
            if k in dense:
                p.copy_(torch.from_numpy(np.asarray(dense[k], dtype=np.float32)))
    load_plane_into(model, arch, state, dtype="float32", quantized=quantized)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 128, size=20)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = model(mx.array([ids])).astype(mx.float32)
    got = np.array(got - mx.logsumexp(got, axis=-1, keepdims=True))[0]
    assert np.abs(got - ref).max() < (5e-3 if plane == "int8g64" else 1e-4), np.abs(got - ref).max()


def test_an_r2_join_card_names_the_store():
    from worker_contract.worker.__main__ import default_store

    assert default_store({"R2_BUCKET": "fleet", "R2_ACCOUNT_ID": "a"}) == "r2://fleet"
    assert default_store({"DRL_STORE": "s3://b", "R2_BUCKET": "fleet"}) == "s3://b"
    assert default_store({}) is None
