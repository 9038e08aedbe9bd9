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
    if recorder is not None:
        recorder.clear()
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


class _Batch:
    """A turn's merged HF cache: rows left-padded to one length, their attention mask and next positions."""

    __slots__ = ("cache", "mask", "pos")

    def __init__(self, cache, mask: torch.Tensor, pos: torch.Tensor):
        self.cache, self.mask, self.pos = cache, mask, pos


def _layer_kind(layer) -> str:
    """'attn' (keys/values along the sequence), 'conv' (LFM2's per-row conv state), else refused."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    if isinstance(layer, LinearAttentionCacheLayerMixin) and not hasattr(layer, "keys"):
        return "conv"
    if type(layer) is DynamicLayer:
        return "attn"
    raise ValueError(f"the torch worker cannot batch a {type(layer).__name__} cache layer across samples")


def _with_layers(template, layers):
    """A cache object like `template` holding `layers`; each conv layer's length counter (which transformers
    updates in place, and which `get_seq_length` reads when the first layer is a conv) and flag dicts made
    its own, set to the attention length."""
    import copy

    out = copy.copy(template)
    out.layers = layers
    seq = next((layer.keys.shape[-2] for layer in layers if _layer_kind(layer) == "attn"), None)
    for layer in layers:
        if _layer_kind(layer) == "conv":
            for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                         "conv_kernel_size"):
                setattr(layer, name, dict(getattr(layer, name)))
            n = int(layer.cumulative_length_linear) if seq is None else seq
            layer.cumulative_length_linear = torch.tensor(n, dtype=torch.long, device=layer.conv_states[0].device
                                                          if layer.conv_states.get(0) is not None else None)
    return out


def merge_caches(states: list) -> tuple:
    """Batch-1 HF `DynamicCache`s -> one cache of len(states) rows, left-padded to the longest; (cache,
    lengths). Written here because transformers' caches only select or repeat rows of one batch; none
    stacks caches of different lengths."""
    import copy

    lens = [s.get_seq_length() for s in states]
    width = max(lens)
    layers = []
    for per in zip(*(s.layers for s in states), strict=True):
        new = copy.copy(per[0])
        if _layer_kind(per[0]) == "attn":
            pad = [(0, 0, width - n, 0) for n in lens]
            new.keys = torch.cat([torch.nn.functional.pad(x.keys, p) for x, p in zip(per, pad, strict=True)])
            new.values = torch.cat([torch.nn.functional.pad(x.values, p) for x, p in zip(per, pad, strict=True)])
        else:
            new.conv_states = {k: None if v is None else torch.cat([x.conv_states[k] for x in per])
                               for k, v in per[0].conv_states.items()}
            new.recurrent_states = {k: None if v is None else torch.cat([x.recurrent_states[k] for x in per])
                                    for k, v in per[0].recurrent_states.items()}
        layers.append(new)
    return _with_layers(states[0], layers), lens


def _rows_of(cache, rows: torch.Tensor, trim: int = 0):
    """The cache's given rows (a copy), attention dropped of its first `trim` positions."""
    import copy

    layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if _layer_kind(layer) == "attn":
            new.keys, new.values = layer.keys[rows, :, trim:], layer.values[rows, :, trim:]
        else:
            new.conv_states = {k: None if v is None else v[rows] for k, v in layer.conv_states.items()}
            new.recurrent_states = {k: None if v is None else v[rows] for k, v in layer.recurrent_states.items()}
        layers.append(new)
    return _with_layers(cache, layers)


def _roll_rows(x: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """Each row (dim 0) of x rolled right along `dim` by its own shift: a right-padded row becomes left-padded."""
    size = x.shape[dim]
    idx = (torch.arange(size, device=x.device)[None] - shifts[:, None]) % size  # [rows, size]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = size
    return x.gather(dim, idx.reshape(shape).expand(x.shape))


class TorchEngine:
    """The episode generator's backend (worker/episodes.py): one batch-1 HF cache per sample, extended in
    place (`DynamicCache`; LFM2's conv state lives in the same cache object), cloned by deep copy, merged
    left-padded for a turn's batched decoding (an attention mask hides the padding; positions are each
    row's own). Each sample draws with its own `torch.Generator` (exponential race: the same distribution
    as multinomial, one stream per sample)."""

    def __init__(self, model, decode, *, temperature: float, top_p: float, greedy: bool = False,
                 generator: torch.Generator | None = None, recorder=None):
        self.model, self.decode, self.recorder = model, decode, recorder
        self.temperature, self.top_p, self.greedy, self.generator = temperature, top_p, greedy, generator
        if recorder is not None:
            recorder.clear()  # from here every forward is this engine's, taken after it
        self.device = next(model.parameters()).device
        self.cache_kw = _cache_kwarg(model)
        self.forwards = 0

    @torch.inference_mode()
    def prefill(self, ids: list[int], state):
        """Feed ids after what `state` holds; positions continue from the cache's length."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kw = {} if state is None else {self.cache_kw: state}
        out = self.model(input_ids=x, use_cache=True, **kw)
        self.forwards += 1
        return getattr(out, self.cache_kw), out.logits[:, -1]

    def clone(self, state):
        import copy

        return copy.deepcopy(state)

    def streams(self, n: int) -> list[torch.Generator]:
        base = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))
        return [torch.Generator(device=self.device).manual_seed(base + i) for i in range(n)]

    def _merged(self, states: list) -> _Batch:
        """The rows' caches merged left-padded, with the mask hiding the padding and each row's next position."""
        cache, lens = merge_caches(states)
        width = max(lens)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lens], dtype=torch.long, device=self.device)
        return _Batch(cache, mask, torch.tensor(lens, dtype=torch.long, device=self.device))

    def merge(self, states: list, logits: list):
        return self._merged(states), torch.cat(logits)

    def take_routes(self):
        """MoE: uint8 [rows, tokens, layers, top_k] of the forwards since the last take; None for a dense model."""
        return None if self.recorder is None else self.recorder.take()

    @torch.inference_mode()
    def extend(self, states: list, feeds: list[list[int]]):
        """One forward of the rows right-padded to the longest feed, written here because transformers has no
        ragged extension of a batch: attention masked and rolled afterwards so the padding is on the left, as
        `merge` leaves it; each LFM2 conv state cut at its row's end out of the full states transformers keeps
        while recording the past (`activate_past_recording`). None where a conv cache cannot record it."""
        batch = self._merged(states)
        conv = [layer for layer in batch.cache.layers if _layer_kind(layer) == "conv"]
        if not all(hasattr(layer, "activate_past_recording") for layer in conv):
            return None
        for layer in conv:
            layer.activate_past_recording()
        dev = self.device
        n = torch.tensor([len(f) for f in feeds], dtype=torch.long, device=dev)
        longest = int(n.max())
        ids = torch.tensor([f + [0] * (longest - len(f)) for f in feeds], dtype=torch.long, device=dev)
        mask = torch.cat([batch.mask, (torch.arange(longest, device=dev)[None] < n[:, None]).long()], dim=1)
        keep = longest - int(n.min()) + 1  # the logits of every row's last position, and no more
        out = self.model(input_ids=ids, attention_mask=mask,
                         position_ids=batch.pos[:, None] + torch.arange(longest, device=dev)[None], use_cache=True,
                         logits_to_keep=keep, **{self.cache_kw: batch.cache})
        self.forwards += 1
        cache, pad = getattr(out, self.cache_kw), longest - n
        logits = out.logits[torch.arange(len(feeds), device=dev), n - 1 - (longest - keep)]
        for layer in cache.layers:
            if _layer_kind(layer) == "attn":
                layer.keys, layer.values = _roll_rows(layer.keys, pad, 2), _roll_rows(layer.values, pad, 2)
                continue
            for k, full in layer.conv_states.items():  # [rows, channels, kernel + longest] -> the kernel's last
                if full is not None:
                    size = layer.conv_kernel_size[k]
                    idx = (n[:, None] + torch.arange(size, device=dev)[None])[:, None].expand(-1, full.shape[1], -1)
                    layer.conv_states[k] = full.gather(2, idx)
            layer.record_past = False
        return _Batch(_with_layers(cache, cache.layers), _roll_rows(mask, pad, 1), batch.pos + n), logits

    @torch.inference_mode()
    def forward(self, batch: _Batch, tokens: list[int]):
        """The model on a batch, one new token per row (a route recorder's take gives its rows in batch order)."""
        self.forwards += 1
        batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        out = self.model(input_ids=x, attention_mask=batch.mask, position_ids=batch.pos[:, None], use_cache=True,
                         **{self.cache_kw: batch.cache})
        batch.cache, batch.pos = getattr(out, self.cache_kw), batch.pos + 1
        return out.logits[:, -1]

    def extract(self, batch: _Batch, row: int):
        pad = int((batch.mask[row] == 0).sum())
        return _rows_of(batch.cache, torch.tensor([row], device=self.device), trim=pad)

    def keep(self, batch: _Batch, rows: list[int]) -> _Batch:
        idx = torch.tensor(rows, device=self.device)
        mask = batch.mask[idx]
        trim = int((mask == 0).all(dim=0).long().cumprod(0).sum())  # padding every kept row has: dropped
        return _Batch(_rows_of(batch.cache, idx, trim), mask[:, trim:], batch.pos[idx])

    @torch.inference_mode()
    def pick(self, logits, streams: list[torch.Generator]) -> tuple[list[int], list[float]]:
        if self.greedy:
            logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            tok = logp.argmax(dim=-1)
        else:
            logp = nucleus_logprobs(logits, self.temperature, self.top_p)
            race = torch.stack([torch.empty(logp.shape[-1], device=logp.device).exponential_(generator=g)
                                for g in streams])
            tok = (logp - race.log()).argmax(dim=-1)  # argmax of p / E, E ~ Exp(1): a draw from p
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        return tok.tolist(), lp.tolist()
