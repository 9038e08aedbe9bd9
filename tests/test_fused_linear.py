"""Linears that add weight gradients into a float32 `main_grad` (trainer/models/fused_linear.py), on the CPU.

Megatron's own linears are the reference: same outputs, same input gradients, and the weight gradients
that autograd would have produced, found in `main_grad` instead (summed over micro-batches); under
tensor parallelism 2 the column-parallel input gradient must be all-reduced by our backward.
"""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu

HIDDEN, FFN = 8, 12


@pytest.fixture(scope="module")
def mcore():
    torch.set_num_threads(1)
    megatron_cpu.init_distributed()
    yield


def _full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(FFN, HIDDEN, generator=g) / 3, "b1": torch.randn(FFN, generator=g) / 3,
            "w2": torch.randn(HIDDEN, FFN, generator=g) / 3}


def _pair(dtype: torch.dtype, *, ours: bool, rank: int = 0, size: int = 1):
    """fc1 (column-parallel, bias) and fc2 (row-parallel), loaded with this rank's shards."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from trainer.models.fused_linear import linear_classes

    column, row = linear_classes() if ours else (ColumnParallelLinear, RowParallelLinear)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, params_dtype=dtype,
                            use_cpu_initialization=True, tensor_model_parallel_size=size)
    init = torch.nn.init.zeros_
    fc1 = column(HIDDEN, FFN, config=cfg, init_method=init, bias=True, gather_output=False)
    fc2 = row(FFN, HIDDEN, config=cfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False)
    full = _full_weights()
    with torch.no_grad():
        fc1.weight.copy_(full["w1"].chunk(size, 0)[rank])
        fc1.bias.copy_(full["b1"].chunk(size, 0)[rank])
        fc2.weight.copy_(full["w2"].chunk(size, 1)[rank])
    return fc1, fc2


def _run(fc1, fc2, dtype: torch.dtype, *, main_grad: bool, micro_batches: int = 2):
    """Backward over a few micro-batches; returns input gradients and the weight gradients."""
    if main_grad:
        for w in (fc1.weight, fc2.weight):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    x_grads = []
    for _ in range(micro_batches):
        x = torch.randn(5, 3, HIDDEN, generator=g).to(dtype).requires_grad_(True)
        h, _ = fc1(x)
        y, _ = fc2(h * h)
        (y.float() * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        x_grads.append(x.grad)
    if main_grad:
        weights = [fc1.weight.main_grad, fc2.weight.main_grad]
    else:
        weights = [fc1.weight.grad.float(), fc2.weight.grad.float()]
    return torch.stack(x_grads), weights, fc1.bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_gradients_as_megatron_linears_found_in_main_grad(mcore, dtype):
    want_x, want_w, want_b = _run(*_pair(dtype, ours=False), dtype, main_grad=False)
    fc1, fc2 = _pair(dtype, ours=True)
    got_x, got_w, got_b = _run(fc1, fc2, dtype, main_grad=True)
    assert fc1.weight.grad is None and fc2.weight.grad is None  # nothing went through autograd's .grad
    assert torch.equal(got_x, want_x) and torch.equal(got_b, want_b)
    # float32: equal to rounding; bf16: ours sums in float32, autograd summed two bf16 gradients
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(got_w, want_w, strict=True):
        assert (got - want).abs().max() <= tol * want.abs().max()


def test_without_main_grad_they_are_megatrons_linears(mcore):
    fc1, fc2 = _pair(torch.float32, ours=True)
    x, (w1, w2), _ = _run(fc1, fc2, torch.float32, main_grad=False)  # .grad filled by megatron's path
    want_x, want_w, _ = _run(*_pair(torch.float32, ours=False), torch.float32, main_grad=False)
    assert torch.equal(x, want_x) and torch.equal(w1, want_w[0]) and torch.equal(w2, want_w[1])


def _tp_rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    megatron_cpu.init_distributed(rank, 2, port, tp=2)
    fc1, fc2 = _pair(torch.float32, ours=True, rank=rank, size=2)
    torch.save(_run(fc1, fc2, torch.float32, main_grad=True), f"{out}.{rank}")


@pytest.mark.slow
def test_tensor_parallel_2_all_reduces_the_input_gradient(tmp_path, mcore):
    want_x, (w1, w2), want_b = _run(*_pair(torch.float32, ours=True), torch.float32, main_grad=True)
    out = str(tmp_path / "tp")
    megatron_cpu.spawn_on_a_free_port(_tp_rank, (out,), nprocs=2)
    for rank in range(2):
        x, (g1, g2), b = torch.load(f"{out}.{rank}", weights_only=False)
        assert (x - want_x).abs().max() < 1e-5  # every rank has the whole input gradient
        assert (g1 - w1.chunk(2, 0)[rank]).abs().max() < 1e-5
        assert (g2 - w2.chunk(2, 1)[rank]).abs().max() < 1e-5
        assert (b - want_b.chunk(2, 0)[rank]).abs().max() < 1e-5


def test_probe_is_off_on_the_cpu_and_accumulation_is_exact_there():
    from trainer.models.fused_linear import accumulate_wgrad, fused_wgrad_available

    assert not fused_wgrad_available("cpu")
    g = torch.randn(7, 4).to(torch.bfloat16)
    x = torch.randn(7, 3).to(torch.bfloat16)
    acc = torch.ones(4, 3)
    accumulate_wgrad(acc, g, x)
    assert torch.allclose(acc, 1 + g.double().t().matmul(x.double()).float(), rtol=0, atol=1e-6)
