"""The megatron backend's memory plan (trainer/backends/megatron_optim.py, megatron_rank.py), on the CPU:
MasterAdamW is torch's AdamW; the recipe's optim.moment_dtype and optim.offload reach the
optimizer (states seen where the plan puts them); compute.gradient_checkpointing recomputes the same step."""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu
from tests.test_lfm2_megatron import _tiny_hf
from trainer.config import resolve


@pytest.fixture(scope="module")
def dist():
    torch.set_num_threads(2)
    megatron_cpu.init_distributed()
    yield
    megatron_cpu.shutdown_distributed()


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in ((64, 32), (300,), (7, 5, 3))]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def test_master_adamw_is_torch_adamw():
    from trainer.backends.megatron_optim import MasterAdamW

    ref, ours = _params(), _params()
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    opt = MasterAdamW(ours, lr=1e-2, weight_decay=0.1, chunk=400)  # several chunks
    for step in range(4):
        for p, g in zip(ref, _grads(ref, step), strict=True):
            p.grad = g
        torch_opt.step()
        torch._foreach_copy_(opt.grads, _grads(ours, step))
        opt.step()
    for a, b in zip(ref, ours, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # bf16 moments: stored in bf16, the same update to bf16 rounding of the moments
    low = _params()
    opt16 = MasterAdamW(low, lr=1e-2, weight_decay=0.1, moments="bfloat16", offload=0.5)
    for step in range(4):
        torch._foreach_copy_(opt16.grads, _grads(low, step))
        opt16.step()
    assert {t.dtype for t in opt16.exp_avg + opt16.exp_avg_sq} == {torch.bfloat16}
    assert {m.dtype for m in opt16.masters} == {torch.float32}
    for a, b in zip(ref, low, strict=True):
        assert (a - b).abs().max() < 1e-3 * 4  # lr x steps bounds the update; the rounding is far below it
    with pytest.raises(ValueError, match="optim.offload"):
        MasterAdamW(low, lr=1e-3, weight_decay=0.0, offload=1.5)


def test_offload_takes_the_largest_parameters_first():
    from trainer.backends.megatron_optim import _offloaded

    params = [torch.empty(n) for n in (10, 1000, 50, 500)]
    assert _offloaded(params, 0.0) == set()
    assert _offloaded(params, 0.5) == {1}          # 1000 of 1560 elements
    assert _offloaded(params, 0.7) == {1, 3}
    assert _offloaded(params, 1.0) == {0, 1, 2, 3}


def _backend(tmp_path, **over):
    from trainer.backends.megatron import MegatronBackend

    model = tmp_path / "hf"
    if not model.exists():
        _tiny_hf(model, dtype=torch.float32)
    plain = {"algo.optim.moment_dtype": "float32", "train.optimizer_offload": 0.0}  # the recipe's plan only if asked
    cfg = resolve("psqa", env={}, overrides={"train.backend": "megatron", "train.engine": "native", "model.dtype": "float32",
                                             "model.hf_id": None, "algo.lr": 1e-3, **plain, **over})
    return MegatronBackend.load(model, cfg, device="cpu", attention="sdpa")


def _step(backend, batch):
    from trainer.objectives import policy_loss

    algo = backend._local.cfg.algo
    batch.ref_logp = backend.logprobs(batch, reference=True)
    return backend.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                                mb.loss_mask, algo))


def test_the_plan_reaches_the_optimizer(dist, tmp_path):
    from trainer.backends.megatron_optim import MasterAdamW

    backend = _backend(tmp_path, **{"algo.optim.moment_dtype": "bfloat16", "train.optimizer_offload": 0.5})
    rank = backend._local
    opt = rank.optimizer
    assert isinstance(opt, MasterAdamW) and rank.grads is opt.grads
    assert {t.dtype for t in opt.exp_avg + opt.exp_avg_sq} == {torch.bfloat16}
    assert {m.dtype for m in opt.masters} == {torch.float32} and {g.dtype for g in opt.grads} == {torch.float32}
    sizes = [p.numel() for p in rank.params]
    host = sum(sizes[i] for i in opt.on_host)
    assert 0.5 * sum(sizes) <= host < 0.5 * sum(sizes) + max(sizes)
    assert max(range(len(sizes)), key=sizes.__getitem__) in opt.on_host
    placed = opt.bytes_by_place()
    assert placed["host"] == sum(sizes[i] * (4 + 2 + 2) for i in opt.on_host)
    if torch.cuda.is_available():  # on a GPU the offloaded states are pinned host memory
        assert all(opt.masters[i].device.type == "cpu" and opt.masters[i].is_pinned() for i in opt.on_host)
    before = [p.detach().clone() for p in rank.params]
    batch = megatron_cpu.random_batch(4, 96)
    m = _step(backend, batch)
    assert m["grad_norm"] > 0 and opt.step_count == 1
    moved = [not torch.equal(a, b) for a, b in zip(before, rank.params, strict=True)]
    assert sum(moved) > len(moved) // 2
    # a checkpoint written under this plan comes back; another plan's is refused
    rank.save_checkpoint(tmp_path)
    masters = [t.clone() for t in opt.masters]
    _step(backend, batch)
    rank.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.masters, strict=True)) and opt.step_count == 1
    with pytest.raises(ValueError, match="another optim.moment_dtype"):
        _backend(tmp_path)._local.load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="not on train.backend: hf"):
        resolve("psqa", env={}, overrides={"algo.optim.moment_dtype": "bfloat16", "train.backend": "hf",
                                           "train.engine": "native", "train.optimizer_offload": 0})
    with pytest.raises(ValueError, match="optim.offload runs on the megatron backend"):
        resolve("psqa", env={}, overrides={"algo.optim.moment_dtype": "float32", "train.backend": "hf",
                                           "train.engine": "native", "train.optimizer_offload": 0.5})


def test_recompute_gives_the_same_step(dist, tmp_path):
    """Every decoder layer recomputed in backward (rope tables kept for it): the same loss and gradient."""
    batch = megatron_cpu.random_batch(4, 96)
    plain = _backend(tmp_path)
    again = _backend(tmp_path, **{"train.gradient_checkpointing": True})
    assert again._local.recompute and not plain._local.recompute
    a, b = _step(plain, batch), _step(again, batch)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for p, q in zip(plain._local.params, again._local.params, strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_recompute_with_main_grads(dist, tmp_path):
    """bf16 compute with weight gradients accumulated into the float32 masters' `main_grad` (as on a GPU),
    under recompute: the recomputed forward's saved weight is a fresh tensor, so the gradient must reach the
    parameter's own main_grad, and the step equals the one without recompute."""
    from trainer.backends.megatron import MegatronBackend

    model = tmp_path / "hf"
    _tiny_hf(model, dtype=torch.float32)
    batch = megatron_cpu.random_batch(4, 96)
    steps = []
    for recompute in (False, True):
        cfg = resolve("psqa", env={}, overrides={"train.backend": "megatron", "train.engine": "native",
                                                 "model.hf_id": None, "algo.lr": 1e-3,
                                                 "train.gradient_checkpointing": recompute})
        backend = MegatronBackend.load(model, cfg, device="cpu", attention="sdpa", compute_dtype=torch.bfloat16,
                                       fused_wgrad=True)
        assert backend._local.fused_wgrad and backend._local.recompute == recompute
        steps.append((_step(backend, batch), [p.detach().clone() for p in backend._local.masters]))
    (a, wa), (b, wb) = steps
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2) and a["grad_norm"] > 0
    assert max((p - q).abs().max().item() for p, q in zip(wa, wb, strict=True)) < 1e-4
