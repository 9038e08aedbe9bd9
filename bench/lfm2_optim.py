"""The memory plan's optimizer candidates, each timed and its memory read, on synthetic expert-shaped
parameters (bf16 weights, float32 gradients on the GPU), scaled to a model's size by the caller:

- torch-fused: torch's fused AdamW on float32 masters, everything on the GPU (the backend's default);
- master-fp32 / master-bf16: MasterAdamW (trainer/backends/megatron_optim.py), moments float32 / bfloat16;
- offload-fp32 / offload-bf16: the same with every state in pinned host memory (offload 1.0);
- megatron-hybrid: megatron-core's HybridDeviceOptimizer, offload 1.0 (torch AdamW on the CPU, fp32).

Run by bench.lfm2_step (`--parts optim`); `--device cpu` runs the MasterAdamW rows only.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

CANDIDATES = ("torch-fused", "master-fp32", "master-bf16", "offload-fp32", "offload-bf16", "megatron-hybrid")
#: elements per synthetic tensor: one LFM2.5-8B-A1B expert's fc1 (2 x 1792 x 2048)
EXPERT = 2 * 1792 * 2048


def _make(kind: str, params: list, grads: list, lr: float) -> Any:
    import torch

    from trainer.backends.megatron_optim import MasterAdamW

    kw: dict[str, Any] = dict(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    if kind == "torch-fused":
        masters = [p.detach().float() for p in params]
        for m, g in zip(masters, grads, strict=True):
            m.grad = g
        return torch.optim.AdamW(masters, fused=params[0].is_cuda or None, **kw)
    if kind.startswith(("master", "offload")):
        opt = MasterAdamW(params, moments="bfloat16" if kind.endswith("bf16") else "float32",
                          offload=1.0 if kind.startswith("offload") else 0.0, **kw)
        opt.grads = grads
        return opt
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    for p, g in zip(params, grads, strict=True):
        p.decoupled_grad = g
    try:
        return HybridDeviceOptimizer(params, offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                                     gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                     overlap_cpu_optimizer_d2h_h2d=True, fused=True, **kw)
    except (RuntimeError, TypeError):
        return HybridDeviceOptimizer(params, offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                                     gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                     overlap_cpu_optimizer_d2h_h2d=True, **kw)


def _host_bytes(opt: Any) -> int:
    """Bytes the optimizer holds in host memory (masters, moments, staging), counted from its tensors."""
    import torch

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    if hasattr(opt, "bytes_by_place"):
        return opt.bytes_by_place()["host"]
    for group in getattr(opt, "cpu_optimizers", []):
        for g in group.param_groups:
            for p in g["params"]:
                add(p)
                add(p.grad)
        for st in group.state.values():
            for t in st.values():
                add(t)
    return sum(seen.values())


def measure(kind: str, elements: float, device: str, steps: int = 3) -> dict:
    """One candidate on about `elements` parameters in expert-sized tensors: build time, median step time,
    device bytes it added (beyond the bf16 weights and float32 gradients) and host bytes."""
    import gc

    import torch

    cuda = device == "cuda"
    n = max(1, int(elements // EXPERT))
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(EXPERT, device=device, generator=gen).to(torch.bfloat16) for _ in range(n)]
    grads = [torch.randn(EXPERT, device=device, generator=gen) * 1e-3 for _ in range(n)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    opt = _make(kind, params, grads, 1e-6)
    sync()
    build = time.perf_counter() - t0
    dev = (torch.cuda.memory_allocated() - base) if cuda else None
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    out = {"elements": n * EXPERT, "build_s": build, "step_s": statistics.median(times[1:] or times), "steps_s": times,
           "device_state_bytes": dev, "host_bytes": _host_bytes(opt),
           "device_state_bytes_per_param": None if dev is None else dev / (n * EXPERT),
           "host_bytes_per_param": _host_bytes(opt) / (n * EXPERT)}
    if cuda:
        out["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    del opt, params, grads
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def offload_agrees(device: str, elements: float = 2.5e8, steps: int = 3) -> dict:
    """The same steps with every state offloaded and with every state on the device (bf16 moments, the same
    weights and gradients): the weights and masters must come out bit for bit equal, since only where the
    states live differs (the copies through the side streams, not the arithmetic)."""
    import torch

    from trainer.backends.megatron_optim import MasterAdamW

    n = max(1, int(elements // EXPERT))
    gen = torch.Generator(device=device).manual_seed(1)
    weights = [torch.randn(EXPERT, device=device, generator=gen).to(torch.bfloat16) for _ in range(n)]
    grads = [[torch.randn(EXPERT, device=device, generator=gen) * 1e-3 for _ in range(n)] for _ in range(steps)]
    ends = {}
    for offload in (0.0, 1.0):
        params = [w.clone() for w in weights]
        opt = MasterAdamW(params, lr=1e-4, weight_decay=0.01, moments="bfloat16", offload=offload)
        for g in grads:
            torch._foreach_copy_(opt.grads, g)
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        ends[offload] = (params, [m.to(device) for m in opt.masters])
    (p0, m0), (p1, m1) = ends[0.0], ends[1.0]
    same = all(torch.equal(a, b) for a, b in zip(p0 + m0, p1 + m1, strict=True))
    return {"elements": n * EXPERT, "steps": steps, "weights_and_masters_equal": bool(same)}


def run(elements: float, device: str, scale_to: float) -> dict:
    """Every candidate (MasterAdamW's only off CUDA), each also scaled to `scale_to` parameters."""
    import torch

    kinds = CANDIDATES if device == "cuda" else ("master-fp32", "master-bf16", "offload-bf16")
    out: dict[str, Any] = {}
    for kind in kinds:
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            r = measure(kind, elements, device)
            f = scale_to / r["elements"]
            r["scaled"] = {"params": scale_to, "step_s": r["step_s"] * f, "host_gib": r["host_bytes"] * f / 2**30,
                           "device_state_gib": None if r["device_state_bytes"] is None
                           else r["device_state_bytes"] * f / 2**30}
        except Exception as e:  # one candidate failing must not lose the others
            import traceback

            r = {"error": f"{type(e).__name__}: {str(e)[:400]}", "traceback": traceback.format_exc()[-1500:]}
        print(f"  optimizer {kind}: {r.get('step_s', r.get('error'))}", flush=True)
        out[kind] = r
    out["offload_agrees"] = offload_agrees(device, elements=min(elements, 2.5e8))
    print(f"  offloaded == resident after {out['offload_agrees']['steps']} steps: "
          f"{out['offload_agrees']['weights_and_masters_equal']}", flush=True)
    return out
