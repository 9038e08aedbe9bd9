"""The MLX worker's sampler: one prompt prefill shared by the group, honest behaviour log-probs.

mlx-lm's `generate` reports the raw log-softmax, taken before temperature and top-p; here each token's
log-prob is recorded under the very distribution it was drawn from, from the forward that sampled it.
More in docs/mac-worker.md (module notes).
"""

from __future__ import annotations

from .completion import Completion

#: positions per prefill call, all rows together (bounds its logits' and activations' memory on long prompts)
PREFILL_CHUNK = 512


def nucleus_logprobs(logits, temperature: float, top_p: float):
    """Log-probs [rows, vocab] of the distribution sampled from: softmax(logits / T), cut to top_p."""
    import mlx.core as mx

    logp = logits.astype(mx.float32) / temperature
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    if top_p >= 1.0:
        return logp
    order = mx.argsort(-logp, axis=-1)
    sorted_p = mx.exp(mx.take_along_axis(logp, order, axis=-1))
    drop_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) >= top_p  # the top token always survives
    drop = mx.take_along_axis(drop_sorted, mx.argsort(order, axis=-1), axis=-1)
    logp = mx.where(drop, -mx.inf, logp)
    return logp - mx.logsumexp(logp, axis=-1, keepdims=True)


def _expand(cache, n: int) -> None:
    """Repeat a batch-1 layer cache into n identical rows."""
    import mlx.core as mx

    if hasattr(cache, "keys") and hasattr(cache, "offset") and cache.keys is not None:  # KVCache
        cache.keys = mx.repeat(cache.keys[..., : cache.offset, :], n, axis=0)
        cache.values = mx.repeat(cache.values[..., : cache.offset, :], n, axis=0)
    elif hasattr(cache, "cache") and isinstance(cache.cache, list):  # ArraysCache (LFM2's conv state)
        if getattr(cache, "lengths", None) is not None or getattr(cache, "left_padding", None) is not None:
            raise ValueError("a padded ArraysCache cannot be shared across a group")
        cache.cache = [None if a is None else mx.repeat(a, n, axis=0) for a in cache.cache]
    else:
        raise ValueError(f"the MLX worker cannot share a {type(cache).__name__} across a group")


def _keep(cache, rows) -> None:
    """Keep only the given batch rows of a layer cache (rows: an mx index array)."""
    if hasattr(cache, "keys") and hasattr(cache, "offset") and cache.keys is not None:
        cache.keys, cache.values = cache.keys[rows], cache.values[rows]
    elif hasattr(cache, "cache") and isinstance(cache.cache, list):
        cache.cache = [None if a is None else a[rows] for a in cache.cache]


def sample_group(model, prompt: list[int], n: int, *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_ids: list[int], key, recorder=None) -> list[Completion]:
    """n completions of one prompt from one shared prefill; each token's log-prob from its own forward. With a
    `recorder` (worker/route_recorder.py) the prompt's routes (recorded once) and each sample's come along."""
    import mlx.core as mx

    assert prompt and n > 0 and max_new_tokens > 0
    if recorder is not None:
        recorder.clear()
    cache, logits = _shared_prefill(model, prompt, n)
    prompt_routes = None if recorder is None else recorder.take()[0]
    routes: list[list] = [[] for _ in range(n)]
    eos = set(eos_ids)
    toks: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    finish = ["length"] * n
    active = list(range(n))  # sample index of each batch row
    for step in range(max_new_tokens):
        key, sub = mx.random.split(key)
        logp = nucleus_logprobs(logits, temperature, top_p)
        tok = mx.random.categorical(logp, axis=-1, key=sub)
        lp = mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
        mx.eval(tok, lp)
        keep = []
        for row, (t, v) in enumerate(zip(tok.tolist(), lp.tolist(), strict=True)):
            i = active[row]
            toks[i].append(t)
            lps[i].append(v)
            if t in eos:
                finish[i] = "stop"
            else:
                keep.append(row)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(active):
            rows = mx.array(keep, dtype=mx.int32)
            for c in cache:
                _keep(c, rows)
            tok = tok[rows]
            active = [active[r] for r in keep]
        logits = model(tok[:, None].astype(mx.int32), cache=cache)[:, -1, :]
        if recorder is not None:
            step_routes = recorder.take()
            for row, i in enumerate(active):
                routes[i].append(step_routes[row, 0])
    out = [Completion(toks[i], lps[i], finish[i]) for i in range(n)]
    if recorder is not None:
        _attach_routes(out, prompt_routes, routes)
    return out


def _shared_prefill(model, prompt: list[int], n: int):
    """The prompt prefilled once (in chunks), its cache and last logits repeated for n samples."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array(prompt, dtype=mx.int32)[None]
    for start in range(0, len(prompt), PREFILL_CHUNK):
        logits = model(ids[:, start:start + PREFILL_CHUNK], cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    for c in cache:
        _expand(c, n)
    return cache, mx.repeat(logits, n, axis=0)


def _merge_caches(states: list) -> list:
    """Batch-1 prompt caches -> mlx-lm's batch caches, layer by layer (each cache type's own `merge`)."""
    return [type(layers[0]).merge(list(layers)) for layers in zip(*states, strict=True)]


def _attach_routes(out: list[Completion], prompt_routes, routes: list[list]) -> None:
    """Each completion's routes: the shared prompt's, and one row per sampled token that was fed back (the
    last token is never fed, so it has none)."""
    import numpy as np

    for i, c in enumerate(out):
        c.prompt_routes = prompt_routes
        c.routes = (np.stack(routes[i][:len(c.token_ids) - 1]) if len(c.token_ids) > 1
                    else np.zeros((0, *prompt_routes.shape[1:]), dtype=np.uint8))


class MlxEngine:
    """The episode generator's backend (worker/episodes.py) on mlx-lm's caches: a sample's batch-1 prompt
    cache is extended by feeding it new tokens; a turn's samples are merged into mlx-lm's batch caches
    (`BatchKVCache` left-pads attention; LFM2's conv state `ArraysCache` stacks) and split back with their
    `extract`/`filter`. mlx-lm's `BatchGenerator` itself is not used: it samples from the raw logits through
    its own sampler and reports the log-softmax before temperature and top-p (not the distribution drawn
    from), draws one key for the whole batch (a sample's tokens would then depend on which others share its
    batch), and has no way to take a sample out at `</search>` and put it back with its cache extended by a
    tool turn while sharing the group's one prompt prefill."""

    def __init__(self, model, decode, *, temperature: float, top_p: float, key, recorder=None):
        self.model, self.decode, self.recorder = model, decode, recorder
        self.temperature, self.top_p, self.key = temperature, top_p, key
        if recorder is not None:
            recorder.clear()  # from here every forward is this engine's, taken after it
        self.forwards = 0

    def prefill(self, ids: list[int], state):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model) if state is None else state
        x = mx.array(ids, dtype=mx.int32)[None]
        for start in range(0, len(ids), PREFILL_CHUNK):
            logits = self.model(x[:, start:start + PREFILL_CHUNK], cache=cache)[:, -1, :]
            self.forwards += 1
        mx.eval(logits, [c.state for c in cache])
        return cache, logits

    def take_routes(self):
        """MoE: uint8 [rows, tokens, layers, top_k] of the forwards since the last take; None for a dense model."""
        return None if self.recorder is None else self.recorder.take()

    def clone(self, state):
        import copy

        out = []
        for c in state:
            d = copy.copy(c)
            _expand(d, 1)  # mx.repeat(..., 1): new arrays, trimmed to the cache's offset
            out.append(d)
        return out

    def streams(self, n: int) -> list:
        import mlx.core as mx

        self.key, sub = mx.random.split(self.key)
        return [[k] for k in mx.random.split(sub, n)]  # a mutable holder per sample: [its current key]

    def merge(self, states: list, logits: list):
        import mlx.core as mx

        return _merge_caches(states), mx.concatenate(logits, axis=0)

    def extend(self, states: list, feeds: list[list[int]]):
        """mlx-lm's own ragged extension of a batch (its batch caches' `prepare`/`finalize`, as its batched
        generator feeds prompts of different lengths): rows right-padded, each conv state taken at its row's
        end (`lengths`), the attention's padding rolled to the left afterwards. In chunks of PREFILL_CHUNK
        positions over all rows, as a prefill is; None where this mlx-lm's caches have no `prepare`."""
        import mlx.core as mx

        batch = _merge_caches(states)
        if not all(callable(getattr(c, "prepare", None)) and callable(getattr(c, "finalize", None)) for c in batch):
            return None
        lengths = [len(f) for f in feeds]
        width, pad = max(lengths), [max(lengths) - n for n in lengths]
        x = mx.array([f + [0] * p for f, p in zip(feeds, pad, strict=True)], dtype=mx.int32)
        step = max(1, PREFILL_CHUNK // len(feeds))
        last: list = [None] * len(feeds)
        for start in range(0, width, step):
            for c in batch:  # each row's real positions within this chunk
                c.prepare(lengths=[min(max(n - start, 0), step) for n in lengths], right_padding=pad)
            out = self.model(x[:, start:start + step], cache=batch)
            self.forwards += 1
            for r, n in enumerate(lengths):
                if start < n <= start + step:
                    last[r] = out[r, n - 1 - start]
            mx.eval([a for a in last if a is not None], [c.state for c in batch])
        for c in batch:
            c.finalize()
        logits = mx.stack(last)
        mx.eval(logits, [c.state for c in batch])
        return batch, logits

    def forward(self, batch, tokens: list[int]):
        """The model on a batch, one new token per row (a route recorder's take gives its rows in batch order)."""
        import mlx.core as mx

        self.forwards += 1
        return self.model(mx.array(tokens, dtype=mx.int32)[:, None], cache=batch)[:, -1, :]

    def extract(self, batch, row: int):
        return [c.extract(row) for c in batch]

    def keep(self, batch, rows: list[int]):
        import mlx.core as mx

        idx = mx.array(rows, dtype=mx.int32)
        for c in batch:
            c.filter(idx)
        return batch

    def pick(self, logits, streams: list) -> tuple[list[int], list[float]]:
        """Row r drawn with its sample's own key (a batch's draw never depends on who else is in it); one
        host synchronisation for the whole batch."""
        import mlx.core as mx

        logp = nucleus_logprobs(logits, self.temperature, self.top_p)
        drawn = []
        for r, s in enumerate(streams):
            s[0], sub = mx.random.split(s[0])
            drawn.append(mx.random.categorical(logp[r], key=sub))
        tok = mx.stack(drawn)
        lp = mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
        mx.eval(tok, lp)
        return tok.tolist(), lp.tolist()
