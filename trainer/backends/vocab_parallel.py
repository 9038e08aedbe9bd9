"""Token log-probs from a vocabulary-sharded output layer, without gathering the full vocabulary.

Each tensor-parallel rank holds rows [start, start + V_local) of the output embedding. A rank computes its
logits for a chunk of tokens (bf16 operands, float32 results), divides by the temperature, and takes its
local log-sum-exp and target logit; only those [tokens]-sized vectors are all-reduced across ranks. The
float32 logits of a chunk are never larger than `chunk_tokens x V_local`.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 2048
#: float32 logits of one token chunk stay under this many bytes (`chunk_tokens_for`)
LOGITS_BUDGET = 2 << 30

log = logging.getLogger(__name__)
#: what this process learned about its torch: {"out_dtype": bool, "compiled": bool}
FEATURES: dict[str, bool] = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 output; bf16/fp16 operands stay in their dtype (tensor cores) on CUDA.

    Rounding the logits to bf16 would cost ~0.05 nats on logits of size ~20, as large as the policy
    change of an RL step, so they come out of the GEMM in float32 (`torch.mm(..., out_dtype=)`).
    """
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and FEATURES.get("out_dtype", True):
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            FEATURES["out_dtype"] = True
            return out
        except (RuntimeError, TypeError) as e:  # older torch: float32 operands (exact for bf16 values)
            FEATURES["out_dtype"] = False
            log.warning("torch.mm(out_dtype=float32) unavailable (%s); using float32 operands", e)
    return torch.mm(a.float(), b.float())


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, valid: int) -> torch.Tensor:
    """Unscaled float32 logits of a token chunk; padded vocabulary rows (not tokens) set to -inf."""
    logits = _mm_f32(h, w.t())
    if valid < w.shape[0]:
        logits[:, valid:] = float("-inf")
    return logits


def _lse_eager(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    return torch.logsumexp(logits * inv_t if inv_t != 1.0 else logits, dim=1)


def _grad_eager(logits: torch.Tensor, inv_t: float, lse: torch.Tensor, coef: torch.Tensor, target: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """(onehot(target) - softmax(logits * inv_t)) * coef in float32, then cast to the operands' dtype.
    `target` is the local column, -1 where the token lives on another rank."""
    probs = torch.exp(logits * inv_t - lse[:, None])
    cols = torch.arange(logits.shape[1], device=logits.device)
    onehot = (cols[None, :] == target[:, None]).to(torch.float32)
    return ((onehot - probs) * coef[:, None]).to(dtype)


_FUSED: dict[str, object] = {}


def _with_fallback(name: str, fused, eager):
    """Call the compiled function; if compiling fails (no triton, no compiler), use eager from then on."""

    def call(*args):
        if FEATURES.get("compiled", True):
            try:
                out = fused(*args)
                FEATURES["compiled"] = True
                return out
            except Exception as e:  # the eager version computes the same thing, only slower
                FEATURES["compiled"] = False
                log.warning("torch.compile of %s failed (%s); running it eagerly", name, e)
        return eager(*args)

    return call


def _kernels(device: torch.device):
    """(lse, grad) functions: torch.compile'd on CUDA (one pass over the logits instead of four or five:
    the logits are the largest tensors of the step), eager elsewhere or if compilation fails."""
    if device.type != "cuda":
        return _lse_eager, _grad_eager
    if "lse" not in _FUSED:
        _FUSED["lse"] = _with_fallback("lse", torch.compile(_lse_eager, dynamic=True), _lse_eager)
        _FUSED["grad"] = _with_fallback("grad", torch.compile(_grad_eager, dynamic=True), _grad_eager)
    return _FUSED["lse"], _FUSED["grad"]


def _allreduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, vocab_start, valid, group, chunk):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        local = targets - vocab_start
        inside = (local >= 0) & (local < valid)
        local = torch.where(inside, local, torch.zeros_like(local))
        lse_fn, _ = _kernels(hidden.device)
        for s in range(0, n, chunk):
            logits = _chunk_logits(hidden[s : s + chunk], weight, valid)
            lse[s : s + chunk] = lse_fn(logits, inv_t)
            got = logits.gather(1, local[s : s + chunk, None]).squeeze(1) * inv_t
            picked[s : s + chunk] = torch.where(inside[s : s + chunk], got, 0.0)
            del logits
        if group is not None and dist.get_world_size(group) > 1:
            peak = _allreduce(lse.clone(), dist.ReduceOp.MAX, group)
            lse = peak + torch.log(_allreduce(torch.exp(lse - peak), dist.ReduceOp.SUM, group))
            _allreduce(picked, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(hidden, weight, local, inside, lse)
        ctx.inv_t, ctx.valid, ctx.chunk = inv_t, valid, chunk
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        from trainer.models.fused_linear import accumulate_wgrad

        hidden, weight, local, inside, lse = ctx.saved_tensors
        inv_t, valid, chunk = ctx.inv_t, ctx.valid, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # the learner's float32 master gradient, when it hands one over (accumulated in the GEMM)
        main_grad = getattr(weight, "main_grad", None) if ctx.needs_input_grad[1] else None
        grad_w = None
        if ctx.needs_input_grad[1] and main_grad is None:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        g = grad_out.float()
        _, grad_fn = _kernels(hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[s:e], weight, valid)
            # d(picked - lse)/d(logit_v) = ([v == target] - softmax_v) * inv_t, times the incoming gradient
            target = torch.where(inside[s:e], local[s:e], -1)
            gl = grad_fn(logits, inv_t, lse[s:e], g[s:e] * inv_t, target, hidden.dtype)
            del logits
            if grad_h is not None:
                grad_h[s:e] = gl @ weight
            if main_grad is not None:
                accumulate_wgrad(main_grad, gl, hidden[s:e])
            elif grad_w is not None:
                grad_w += _mm_f32(gl.t(), hidden[s:e])
        return grad_h, (None if grad_w is None else grad_w.to(weight.dtype)), None, None, None, None, None, None


def chunk_tokens_for(vocab_rows: int, budget_bytes: int = LOGITS_BUDGET) -> int:
    """Tokens per chunk so that a chunk's float32 logits over `vocab_rows` stay under the budget."""
    return max(128, budget_bytes // (4 * max(1, vocab_rows)))


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                            *, vocab_start: int = 0, vocab_size: int | None = None, group=None,
                            chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """log softmax(hidden @ W.T / temperature)[target] per row (float32), W sharded by vocabulary rows.

    hidden [N, H] (the same on every rank), weight [V_local, H] = rows [vocab_start, vocab_start + V_local)
    of the full output embedding, targets [N] global token ids. `vocab_size` is the real vocabulary: rows
    at or above it (Megatron padding) are excluded from the softmax.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    local_rows = weight.shape[0]
    real = local_rows if vocab_size is None else max(0, min(local_rows, vocab_size - vocab_start))
    return _VocabParallelLogprob.apply(hidden, weight, targets, 1.0 / temperature, vocab_start, real, group,
                                       max(1, int(chunk_tokens)))
