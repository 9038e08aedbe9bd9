"""Token sampling that records each token's behaviour log-prob from the forward that produced it.

A short explicit loop instead of `model.generate` (whose generation-config defaults would change the
distribution), so "the log-prob we record is the distribution we drew from" is visible in one place:
the log-softmax of logits / temperature, cut to the top-p nucleus when top_p < 1 (docs/contract.md).
More in docs/contract.md (module notes).
"""

from __future__ import annotations

import torch

from .completion import Completion


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs [rows, vocab] of the distribution sampled from: softmax(logits / T), cut to top_p and
    renormalised (-inf outside the nucleus); exactly the temperature-scaled log-softmax when top_p >= 1."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True, stable=True)
    sorted_p = sorted_lp.exp()
    drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p  # the top token always survives
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool,
          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, their log-probs under the distribution drawn from) for one decoding position of every row."""
    if greedy:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = logp.argmax(dim=-1)
    else:
        logp = nucleus_logprobs(logits, temperature, top_p)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _cache_kwarg(model) -> str:
    """transformers 5 renamed the KV-cache argument and output `past_key_values` -> `cache`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def sample(
    model,
    prompts: list[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    recorder=None,
) -> list[Completion]:
    """Sample one completion per prompt (repeat a prompt to sample a group), with KV caching; with a
    `recorder` (worker/route_recorder.py) each completion carries the routes of its prompt and tokens."""
    assert prompts and all(prompts), "every prompt needs at least one token"
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(eos_ids, device=device)
    cache_kw = _cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    past, logits = getattr(out, cache_kw), out.logits[:, -1]
    routes = [] if recorder is None else [recorder.take()]  # [rows, width, ...], then [rows, 1, ...] a step
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    toks, lps = [], []
    for _ in range(max_new_tokens):
        tok, lp = _pick(logits, temperature, top_p, greedy, generator)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        toks.append(tok)
        lps.append(lp)
        done = done | torch.isin(tok, eos)
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, use_cache=True,
                    **{cache_kw: past})
        past, logits = getattr(out, cache_kw), out.logits[:, -1]
        if recorder is not None:
            routes.append(recorder.take())
    result = _collect(torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist(), set(eos_ids))
    if routes:
        _attach_routes(result, prompts, routes)
    return result


def _attach_routes(result: list[Completion], prompts: list[list[int]], routes: list) -> None:
    """Row i's prompt routes are the last len(prompt) columns of the left-padded prefill; its token j was
    fed by decode step j, so a completion of n tokens has the routes of steps 0 .. n-2."""
    import numpy as np

    prefill, steps = routes[0], routes[1:]
    width = prefill.shape[1]
    for i, (c, p) in enumerate(zip(result, prompts, strict=True)):
        c.prompt_routes = prefill[i, width - len(p):]
        n = len(c.token_ids) - 1
        c.routes = (np.stack([s[i, 0] for s in steps[:n]]) if n > 0
                    else np.zeros((0, *prefill.shape[2:]), dtype=prefill.dtype))


def _collect(tok_rows: list[list[int]], lp_rows: list[list[float]], eos: set[int]) -> list[Completion]:
    result = []
    for toks, lps in zip(tok_rows, lp_rows, strict=True):
        n = next((j + 1 for j, t in enumerate(toks) if t in eos), None)
        if n is None:
            result.append(Completion(toks, lps, "length"))
        else:
            result.append(Completion(toks[:n], lps[:n], "stop"))
    return result


class TorchEngine:
    """The episode generator's backend (worker/episodes.py): one batch-1 HF cache per sample, extended in
    place (`DynamicCache`; LFM2's conv state lives in the same cache object), cloned by deep copy."""

    def __init__(self, model, decode, *, temperature: float, top_p: float, greedy: bool = False,
                 generator: torch.Generator | None = None, recorder=None):
        self.model, self.decode, self.recorder = model, decode, recorder
        self.temperature, self.top_p, self.greedy, self.generator = temperature, top_p, greedy, generator
        self.device = next(model.parameters()).device
        self.cache_kw = _cache_kwarg(model)

    @torch.inference_mode()
    def prefill(self, ids: list[int], state):
        """Feed ids after what `state` holds; positions continue from the cache's length."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kw = {} if state is None else {self.cache_kw: state}
        out = self.model(input_ids=x, use_cache=True, **kw)
        return getattr(out, self.cache_kw), out.logits[:, -1]

    def clone(self, state):
        import copy

        return copy.deepcopy(state)

    def take_routes(self):
        """The routes of the ids the last prefill fed, uint8 [ids, layers, top_k]; None for a dense model."""
        return None if self.recorder is None else self.recorder.take()[0]

    @torch.inference_mode()
    def pick(self, logits) -> tuple[int, float]:
        tok, lp = _pick(logits, self.temperature, self.top_p, self.greedy, self.generator)
        return int(tok[0]), float(lp[0])
