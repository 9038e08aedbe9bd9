"""The megatron-core learner backend on the CPU (gloo, test-only CUDA shims from tests/megatron_cpu.py).

It must be the same learner as the transformers backend: same log-probs, same loss, same gradient norm
and the same weights after optimizer steps, in float32; tensor-parallel 2 must equal 1.
"""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu
from trainer.config import AlgoConfig, ComputeConfig, ModelConfig, OptimConfig, RecipeConfig, TrainConfig
from trainer.models import IdentityMismatch
from trainer.objectives import policy_loss

VOCAB = 64


def recipe(backend: str, tp: int = 1, rotary_base: float | None = None, dtype: str = "float32") -> RecipeConfig:
    return RecipeConfig(
        name="t", task="arithmetic", model=ModelConfig(dtype=dtype, rotary_base=rotary_base),
        algo=AlgoConfig(max_new_tokens=8, temperature=0.8), optim=OptimConfig(lr=1e-3),
        train=TrainConfig(backend=backend), compute=ComputeConfig(micro_batch_size=3, tensor_parallel=tp),
    )


def loss_fn(algo):
    return lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)


@pytest.fixture(scope="module")
def mcore():
    torch.set_num_threads(1)
    megatron_cpu.init_distributed()
    yield


def run_steps(backend, steps: int = 2):
    batch = megatron_cpu.random_batch(7, VOCAB)
    out = {"logp": backend.logprobs(batch)}
    batch.ref_logp = backend.logprobs(batch, reference=True)
    out["ref"] = batch.ref_logp
    fn = loss_fn(recipe("hf").algo)
    out["metrics"] = [backend.train_step(batch, fn) for _ in range(steps)]
    out["state"] = backend.state_dict_hf()
    return out


def assert_same(a: dict, b: dict, tol: float = 2e-5) -> None:
    assert (a["logp"] - b["logp"]).abs().max() < tol
    assert (a["ref"] - b["ref"]).abs().max() < tol
    for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-4, abs=1e-7)
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    assert set(a["state"]) == set(b["state"])
    worst = max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"])
    assert worst < 1e-4, worst


@pytest.mark.parametrize("tied", [True, False])
def test_same_learner_as_transformers_backend(tmp_path, mcore, tied):
    from trainer.backends import get_backend
    from trainer.backends.hf import HFBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=tied, vocab=VOCAB, hidden=32, ffn=64)
    backend_cls = get_backend("megatron")
    mg = backend_cls.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa")
    assert mg.vocab_size == VOCAB
    hf = HFBackend.load(tmp_path, recipe("hf"), device="cpu")
    a, b = run_steps(mg), run_steps(hf)
    assert_same(a, b)
    assert a["metrics"][0]["tokens"] > 0 and a["metrics"][1]["loss"] != a["metrics"][0]["loss"]
    assert ("lm_head.weight" in a["state"]) == (not tied)


def test_checkpoint_round_trip(tmp_path, mcore):
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path / "hf", vocab=VOCAB, hidden=32, ffn=64)
    mg = MegatronBackend.load(tmp_path / "hf", recipe("megatron"), device="cpu", attention="local")
    run_steps(mg, steps=1)
    (tmp_path / "ck").mkdir()
    mg.save_checkpoint(tmp_path / "ck")
    saved = mg.state_dict_hf()
    after = run_steps(mg, steps=1)["state"]
    assert any(not torch.equal(after[k], saved[k]) for k in saved)
    mg.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(mg.state_dict_hf()[k], saved[k]) for k in saved)
    # the optimizer state came back too: the next step from the checkpoint repeats the one taken before
    again = run_steps(mg, steps=1)["state"]
    assert all(torch.equal(again[k], after[k]) for k in after)


@pytest.mark.parametrize("tied", [True, False])
def test_publish_snapshot_owns_its_memory_and_outlives_the_next_step(tmp_path, mcore, tied):
    """The snapshot the step hands the publisher: the HF state, in memory shared with no parameter and no
    other tensor of it (a split of a fused tensor or a norm weight would otherwise be the model's own), so
    the next step cannot change what is being published."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=tied, vocab=VOCAB, hidden=32, ffn=64)
    mg = MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa")
    snap, host = mg.publish_snapshot(), mg.state_dict_hf()
    assert snap.keys() == host.keys() and all(torch.equal(snap[k], host[k]) for k in host)
    live = {p.untyped_storage().data_ptr() for p in mg._local.model.parameters()}
    ptrs = [t.untyped_storage().data_ptr() for t in snap.values()]
    assert not live & set(ptrs) and len(set(ptrs)) == len(ptrs)
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes for t in snap.values())
    run_steps(mg, steps=1)
    assert all(torch.equal(snap[k], host[k]) for k in host)  # untouched by the step
    after = mg.state_dict_hf()
    assert all(not torch.equal(snap[k], after[k]) for k in host)  # which moved every tensor (lr 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the on-device snapshot needs a CUDA GPU")
def test_publish_snapshot_never_leaves_the_gpu(tmp_path, mcore):
    """On a GPU the snapshot is gathered, converted and copied on the device, queued on the stream: no host
    copy and no synchronisation (torch's sync debug mode raises on either), so the step never waits for
    it; it equals the host copy, in the run's dtype."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, vocab=VOCAB, hidden=32, ffn=64)
    mg = MegatronBackend.load(tmp_path, recipe("megatron", dtype="bfloat16"), device="cuda", attention="sdpa")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        snap = mg.publish_snapshot()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = mg.state_dict_hf()
    assert snap.keys() == host.keys()
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in snap.values())
    assert all(torch.equal(snap[k].cpu(), host[k]) for k in host)


def test_launch_refuses_a_different_rotary_base(tmp_path, mcore):
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, vocab=VOCAB, hidden=32, ffn=64, rope_theta=1e6)
    with pytest.raises(IdentityMismatch, match="rotary base 10000 .recipe model.rotary_base.*rope_theta 1000000"):
        MegatronBackend.load(tmp_path, recipe("megatron", rotary_base=10000), device="cpu")


def test_vocab_parallel_logprobs_match_float64():
    from trainer.backends.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    up = torch.randn(37, dtype=torch.float64, generator=g)
    for temp in (1.0, 0.7):
        ref = torch.log_softmax(h @ w.t() / temp, -1).gather(1, t[:, None]).squeeze(1)
        gh, gw = torch.autograd.grad((ref * up).sum(), (h, w))
        hh, ww = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        lp = vocab_parallel_logprobs(hh, ww, t, temp, chunk_tokens=8)  # several token chunks
        gh2, gw2 = torch.autograd.grad((lp * up.float()).sum(), (hh, ww))
        assert (lp.double() - ref).abs().max() < 1e-5
        assert (gh2.double() - gh).abs().max() < 1e-4 and (gw2.double() - gw).abs().max() < 1e-4
        padded = torch.cat([ww.detach(), torch.zeros(6, 16)])  # Megatron vocab padding is not a token
        assert (vocab_parallel_logprobs(hh, padded, t, temp, vocab_size=50) - lp).abs().max() < 1e-5


def _tp2_rank(rank: int, port: int, model_dir: str, out: str, bf16: bool) -> None:
    torch.set_num_threads(1)
    megatron_cpu.init_distributed(rank, 2, port, tp=2)
    from trainer.backends.megatron_rank import MegatronRank

    kw = {"compute_dtype": torch.bfloat16, "fused_wgrad": True} if bf16 else {}
    rank_state = MegatronRank(model_dir, recipe("megatron", tp=2), device="cpu", attention="sdpa", **kw)
    assert rank_state.fused_wgrad == bf16
    result = run_steps(rank_state)
    snap = rank_state.state_dict_hf(on_device=True)  # the publisher's snapshot, gathered over both ranks
    assert snap.keys() == result["state"].keys()
    assert all(torch.equal(snap[k], result["state"][k]) for k in snap)
    if rank == 0:
        torch.save(result, out)


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-main-grad"])
def test_tensor_parallel_2_equals_1(tmp_path, mcore, bf16):
    """Two gloo ranks (spawned processes): sharded weights, vocab-parallel log-probs, TP-aware clipping;
    in bf16 with float32 main gradients too (the column-parallel input gradient is all-reduced by our linear)."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=False, vocab=VOCAB, hidden=32, ffn=64)
    out = tmp_path / "tp2.pt"
    megatron_cpu.spawn_on_a_free_port(_tp2_rank, (str(tmp_path), str(out), bf16), nprocs=2)
    kw = {"compute_dtype": torch.bfloat16, "fused_wgrad": True} if bf16 else {}
    tp1 = run_steps(MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa", **kw))
    got = torch.load(out, weights_only=False)
    if not bf16:
        assert_same(got, tp1)
        return
    # bf16: the same model up to rounding in a different reduction order
    assert (got["logp"] - tp1["logp"]).abs().max() < 0.05
    for a, b in zip(got["metrics"], tp1["metrics"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=0.02)
    assert max((got["state"][k].float() - tp1["state"][k].float()).abs().max().item() for k in got["state"]) < 0.02


def test_float32_main_grads_accumulate_inside_the_linears(tmp_path, mcore):
    """bf16 model: the linear and output-layer weight gradients go straight into the float32 master
    gradients (no bf16 .grad is ever made for them) and the step equals the unfused one."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=True, vocab=VOCAB, hidden=32, ffn=64)

    def load(fused: bool):
        return MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", compute_dtype=torch.bfloat16,
                                    attention="sdpa", **({"fused_wgrad": True} if fused else {}))

    plain, fused = load(False), load(True)
    assert not plain._local.fused_wgrad and fused._local.fused_wgrad  # CPU: off unless asked for
    rank = fused._local
    from trainer.models.fused_linear import is_main_grad_linear

    linears = [m.weight for m in rank.model.modules() if is_main_grad_linear(m)]
    assert len(linears) == 4 * 2  # qkv, proj, fc1, fc2 per layer
    masters = dict(zip((id(p) for p in rank.params), rank.masters, strict=True))
    head = rank._head_weight(rank.model)  # the tied embedding: its lookup gradient still comes as .grad
    assert all(masters[id(w)].grad is w.main_grad for w in [*linears, head])
    seen = []
    for w in linears:
        w.register_hook(seen.append)  # unfused, autograd would pass a bf16 weight gradient here
    a, b = run_steps(plain, steps=1), run_steps(fused, steps=1)
    assert seen and all(g is None for g in seen)  # called, but autograd got no weight gradient
    assert (a["logp"] - b["logp"]).abs().max() == 0  # same weights before the step
    assert b["metrics"][0]["grad_norm"] == pytest.approx(a["metrics"][0]["grad_norm"], rel=1e-3)
    worst = max((a["state"][k].float() - b["state"][k].float()).abs().max().item() for k in a["state"])
    assert worst <= 2 ** -6, worst  # at most a bf16 rounding step apart (lr 1e-3 moves every weight)


def test_bf16_model_with_float32_master_weights(tmp_path, mcore):
    """The GPU precision scheme, run on the CPU: bf16 model, float32 masters and gradient accumulation."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, vocab=VOCAB, hidden=32, ffn=64)
    f32 = run_steps(MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu"), steps=1)
    mg = MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", compute_dtype=torch.bfloat16)
    rank = mg._local
    assert all(p.dtype == torch.bfloat16 for p in rank.params) and all(m.dtype == torch.float32 for m in rank.masters)
    before = [m.detach().clone() for m in rank.masters]
    bf = run_steps(mg, steps=1)
    assert all(p.grad is None for p in rank.params)  # accumulated into the float32 buffers, then freed
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(rank.params, rank.masters, strict=True))
    moved = [(m - b).abs().max().item() for m, b in zip(rank.masters, before, strict=True)]
    assert min(moved) > 0  # every tensor took an update (lr 1e-3)
    assert (bf["logp"] - f32["logp"]).abs().max() < 0.1  # same model, bf16 rounding
    assert bf["metrics"][0]["grad_norm"] == pytest.approx(f32["metrics"][0]["grad_norm"], rel=0.05)


@pytest.mark.slow
def test_tensor_parallel_2_through_ray_actors(tmp_path, mcore, monkeypatch):
    """The product path for TP > 1: two Ray actors (CPU, gloo) behind MegatronBackend, same answers as TP=1."""
    import os

    # Left unset, Ray turns token auth on for the whole pytest process and saves a token under HOME.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=True, vocab=VOCAB, hidden=32, ffn=64)
    repo = str(megatron_cpu.__file__).rsplit("/tests/", 1)[0]
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
        "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}})
    try:
        tp2 = MegatronBackend.load(tmp_path, recipe("megatron", tp=2), device="cpu", attention="sdpa",
                                   setup="tests.megatron_cpu:setup_rank")
        got = run_steps(tp2)
        tp2.shutdown()
    finally:
        ray.shutdown()
    assert_same(got, run_steps(MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa")))


def test_padded_decoder_calls_give_the_same_step(tmp_path, mcore):
    """compute.cuda_graphs pads each micro-batch's length up to a multiple of 128 for its graphs; on the CPU
    the same padded calls run eagerly, and the step must equal the unpadded one."""
    from trainer.backends.megatron import MegatronBackend

    megatron_cpu.make_tiny_qwen2(tmp_path, vocab=VOCAB, hidden=32, ffn=64)
    plain = run_steps(MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa"))
    padded = MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa", cuda_graphs=True)
    graphs = padded._local.graphs
    assert graphs is not None and not graphs.capture
    got = run_steps(padded)
    assert graphs.calls and all(length % 128 == 0 for _, length in graphs.calls)  # lengths here are ~12
    assert_same(got, plain)
    # the reference and behaviour log-probs (no gradient) never go through them
    assert MegatronBackend.load(tmp_path, recipe("megatron"), device="cpu", attention="local",
                                cuda_graphs=True)._local.graphs is None  # megatron's own attention: eager
