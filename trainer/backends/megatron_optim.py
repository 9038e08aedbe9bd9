"""The megatron backend's AdamW on float32 master weights, with the memory plan's two knobs:
`moments` (float32, or bfloat16 as DeepSeek-V3 trained: computed in float32, stored in bf16) and `offload`
(the share of parameters whose master weights and moments live in pinned host memory).

Gradients are always float32 on the GPU (the backward accumulates into them). Offloaded states are not
updated on the CPU: chunk by chunk they are copied to the GPU on a side stream, updated there and copied
back, while the next chunk is in flight, so the update costs PCIe time, not CPU time. The update is torch's
AdamW (decoupled weight decay, bias correction), so with float32 moments and no offload it is the same as
`torch.optim.AdamW` to rounding (tests/test_megatron_optim.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: elements per chunk of the update (bounds its float32 temporaries: about 5 x 4 bytes x this)
CHUNK = 1 << 26


class MasterAdamW:
    """AdamW over float32 masters of `params` (the model's low-precision weights, written after each step)."""

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, moments: str = "float32",
                 offload: float = 0.0, chunk: int = CHUNK):
        if moments not in _MOMENT_DTYPES:
            raise ValueError(f"optim.moment_dtype={moments!r}; choose one of {', '.join(_MOMENT_DTYPES)}")
        if not 0.0 <= offload <= 1.0:
            raise ValueError(f"optim.offload={offload} must be between 0 and 1")
        self.params = list(params)
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}]
        self.moment_dtype, self.chunk, self.step_count = _MOMENT_DTYPES[moments], chunk, 0
        self.device = self.params[0].device if self.params else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self.grads = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        self.on_host = _offloaded(self.params, offload)
        self.masters, self.exp_avg, self.exp_avg_sq = [], [], []
        for i, p in enumerate(self.params):
            host = i in self.on_host
            where = dict(device="cpu", pin_memory=cuda) if host else dict(device=p.device)
            m = torch.empty(p.shape, dtype=torch.float32, **where)
            m.copy_(p.detach())
            self.masters.append(m)
            self.exp_avg.append(torch.zeros(p.shape, dtype=self.moment_dtype, **where))
            self.exp_avg_sq.append(torch.zeros(p.shape, dtype=self.moment_dtype, **where))
        # host -> device and device -> host copies on streams of their own: PCIe carries both ways at once
        self._copy = torch.cuda.Stream(self.device) if cuda and self.on_host else None
        self._back = torch.cuda.Stream(self.device) if cuda and self.on_host else None
        # torch.optim's views, for code that reads an optimizer's settings and states
        self.param_groups[0]["params"] = self.masters
        self.state = {m: {"exp_avg": a, "exp_avg_sq": s} for m, a, s in zip(self.masters, self.exp_avg,
                                                                           self.exp_avg_sq, strict=True)}

    # -- what the learner reads --------------------------------------------------------------------------
    def bytes_by_place(self) -> dict[str, int]:
        """Bytes of masters and moments on the device and on the host (the plan, as allocated)."""
        out = {"device": 0, "host": 0}
        for i in range(len(self.params)):
            n = sum(t.numel() * t.element_size() for t in (self.masters[i], self.exp_avg[i], self.exp_avg_sq[i]))
            out["host" if i in self.on_host else "device"] += n
        return out

    def zero_grad(self) -> None:
        torch._foreach_zero_(self.grads)

    # -- the update -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        resident = [i for i in range(len(self.params)) if i not in self.on_host]
        for chunk in _chunks(resident, self.params, self.chunk):
            self._update(chunk, [self.masters[i] for i in chunk], [self.exp_avg[i] for i in chunk],
                         [self.exp_avg_sq[i] for i in chunk])
        self._step_offloaded(sorted(self.on_host))

    def _step_offloaded(self, idx: list[int]) -> None:
        """Host-resident states through the device, two chunks in flight: copy in (one side stream), update
        (current stream), copy back (another side stream, so a chunk goes back while the next comes in); a
        slot's buffers are reused once its copy back is done."""
        if not idx:
            return
        if self._copy is None:  # no GPU: the host is the device
            for chunk in _chunks(idx, self.params, self.chunk):
                self._update(chunk, [self.masters[i] for i in chunk], [self.exp_avg[i] for i in chunk],
                             [self.exp_avg_sq[i] for i in chunk])
            return
        main, copy, back = torch.cuda.current_stream(self.device), self._copy, self._back
        copy.wait_stream(main)  # after everything queued so far (the last step's copies back included)
        freed: list[Any] = [None, None]
        for n, chunk in enumerate(_chunks(idx, self.params, self.chunk)):
            slot = n % 2
            with torch.cuda.stream(copy):
                if freed[slot] is not None:
                    copy.wait_event(freed[slot])
                staged = [[t.to(self.device, non_blocking=True) for t in (self.masters[i], self.exp_avg[i],
                                                                          self.exp_avg_sq[i])] for i in chunk]
                arrived = copy.record_event()
            main.wait_event(arrived)
            for trio in staged:
                for t in trio:
                    t.record_stream(main)
            ms, ea, es = ([s[k] for s in staged] for k in range(3))
            self._update(chunk, ms, ea, es)
            done = main.record_event()
            with torch.cuda.stream(back):
                back.wait_event(done)
                for i, trio in zip(chunk, staged, strict=True):
                    for dst, src in zip((self.masters[i], self.exp_avg[i], self.exp_avg_sq[i]), trio, strict=True):
                        dst.copy_(src, non_blocking=True)
                    for t in trio:
                        t.record_stream(back)  # read here: not reused before this copy is done
                freed[slot] = back.record_event()
        main.wait_stream(back)  # the host copies are complete before anyone reads them (checkpoints)

    def _update(self, idx: list[int], masters: list[torch.Tensor], exp_avg: list[torch.Tensor],
                exp_avg_sq: list[torch.Tensor]) -> None:
        """torch's AdamW on one chunk, in float32; moments stored back in their dtype; weights written."""
        g = self.param_groups[0]
        (b1, b2), lr, wd, eps, t = g["betas"], g["lr"], g["weight_decay"], g["eps"], self.step_count
        grads = [self.grads[i] for i in idx]
        low = self.moment_dtype != torch.float32
        m = [x.float() for x in exp_avg] if low else exp_avg
        v = [x.float() for x in exp_avg_sq] if low else exp_avg_sq
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, 1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - b2 ** t))
        torch._foreach_add_(denom, eps)
        if wd:
            torch._foreach_mul_(masters, 1 - lr * wd)
        torch._foreach_addcdiv_(masters, m, denom, -lr / (1 - b1 ** t))
        if low:
            torch._foreach_copy_(exp_avg, m)
            torch._foreach_copy_(exp_avg_sq, v)
        torch._foreach_copy_([self.params[i] for i in idx], masters)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.device.type == "cuda":  # the host copies of the last step are written by the copy stream
            torch.cuda.current_stream(self.device).synchronize()
        return {"step": self.step_count, "moments": str(self.moment_dtype).removeprefix("torch."),
                "masters": [m.detach() for m in self.masters], "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        for key in ("masters", "exp_avg", "exp_avg_sq"):
            torch._foreach_copy_(getattr(self, key), [t.to(d.device) for t, d in zip(state[key], getattr(self, key),
                                                                                        strict=True)])
        torch._foreach_copy_(self.params, [m.to(p.device) for m, p in zip(self.masters, self.params, strict=True)])


def _offloaded(params: Sequence[torch.Tensor], share: float) -> set[int]:
    """Which parameters' states go to the host: the largest first (the experts' weights), until `share`
    of all elements is reached, so the small ones (norms, router, embeddings' neighbours) stay put."""
    if share <= 0:
        return set()
    total = sum(p.numel() for p in params)
    out, n = set(), 0
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        if n >= share * total - 0.5:
            break
        out.add(i)
        n += params[i].numel()
    return out


def _chunks(idx: list[int], params: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i in idx:
        if cur and n + params[i].numel() > limit:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += params[i].numel()
    if cur:
        out.append(cur)
    return out
