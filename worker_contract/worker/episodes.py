"""Multi-turn search episodes (PaperSearchQA) on either backend, through the task's one episode code.

`sample_episode_group` drives `tasks.psqa.run_episodes` with a generator that keeps one KV cache per sample
(`paged_prefix`): the group's prompt is prefilled once and the cache cloned into its n samples; after a
tool turn a sample's cache is extended by what it has not seen (its last sampled token and the tool
tokens), never re-prefilled from the start. A turn ends after `</search>` or `</answer>` or at EOS. Each
token's log-prob is the one it was drawn under (`Engine.pick`: temperature + nucleus, as single-turn).
`PrefillCount` counts the tokens fed as prefill both ways: as done (extend) and as a worker without the
cache would (every turn's whole context, every sample alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..tasks.psqa import STOP_STRINGS, Encode, Episode, Search, TurnOutput, run_episodes


class Engine(Protocol):
    """What a backend gives the episode generator: one batch-1 cache per sample."""

    def prefill(self, ids: list[int], state: Any | None) -> tuple[Any, Any]:
        """Feed ids into `state` (None: a fresh cache); (state, logits of the last position)."""

    def clone(self, state: Any) -> Any:
        """An independent copy of a cache (later updates of either leave the other untouched)."""

    def pick(self, logits: Any) -> tuple[int, float]:
        """Draw one token; (id, its log-prob under the distribution drawn from)."""

    def decode(self, ids: list[int]) -> str: ...

    def take_routes(self) -> Any | None:
        """MoE models: the routes of the ids the last prefill fed (uint8 [ids, layers, top_k]); else None."""


@dataclass
class PrefillCount:
    """Prefill tokens of one group, fed as done and as a cacheless worker would have fed them."""

    extend: int = 0
    """Tokens fed outside decoding: the prompt once, then each sample's extensions after its tool turns."""
    reprefill: int = 0
    """What re-prefilling every turn's context from the start, per sample, would have fed."""
    turns: int = 0
    """Assistant turns sampled (all samples)."""


class _Row:
    __slots__ = ("covered", "state", "logits", "routes")

    def __init__(self, covered: list[int], state: Any, logits: Any, routes: list | None = None):
        self.covered, self.state, self.logits = covered, state, logits
        self.routes = routes  # MoE: uint8 arrays, one per prefill, covering `covered` token for token


def _feed(engine: Engine, row: _Row, ids: list[int]) -> None:
    """Extend a row's cache by ids; their routes, when the model records them, join the row's."""
    row.state, row.logits = engine.prefill(ids, row.state)
    got = engine.take_routes() if hasattr(engine, "take_routes") else None
    if got is not None:
        row.routes.append(got)


class PrefixGenerator:
    """`GenerateBatch` for run_episodes over per-sample caches that are extended, never rebuilt."""

    def __init__(self, engine: Engine, eos_ids: list[int]):
        self.engine, self.eos = engine, set(eos_ids)
        self.rows: list[_Row] = []
        self.ended: list[_Row] = []  # rows of contexts no longer asked for (their episodes ended)
        self.count = PrefillCount()

    def _row_for(self, ctx: list[int]) -> _Row:
        """The cache holding the longest prefix of `ctx` (any cache of a prefix is valid for it: a cache is
        what its tokens make it), extended by the rest; taken, so no two contexts share one."""
        fits = [j for j, row in enumerate(self.rows)
                if len(row.covered) <= len(ctx) and ctx[:len(row.covered)] == row.covered]
        assert fits, "a context that extends no sample's cache"
        row = self.rows.pop(max(fits, key=lambda j: len(self.rows[j].covered)))
        if len(ctx) > len(row.covered):
            _feed(self.engine, row, ctx[len(row.covered):])
            self.count.extend += len(ctx) - len(row.covered)
            row.covered = list(ctx)
        return row

    def __call__(self, contexts: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        if not self.rows:  # the first turn: every context is the prompt, prefilled once for the group
            assert all(c == contexts[0] for c in contexts), "one prompt per group"
            first = _Row([], None, None, [])
            _feed(self.engine, first, contexts[0])
            self.prompt_routes = first.routes[0] if first.routes else None  # once per group
            self.count.extend += len(contexts[0])
            self.rows = [_Row(list(contexts[0]), first.state if i == 0 else self.engine.clone(first.state),
                              first.logits, list(first.routes)) for i in range(len(contexts))]
        rows = [self._row_for(c) for c in contexts]
        self.ended += self.rows  # what no context took
        self.count.reprefill += sum(len(c) for c in contexts)
        self.count.turns += len(contexts)
        outs = [self._turn(row, budget) for row, budget in zip(rows, budgets, strict=True)]
        self.rows = rows
        return outs

    def episode_routes(self, prompt: list[int], eps: list[Episode]) -> list:
        """Each episode's response routes, as the record carries them (worker_contract/routes.py): the
        tokens before its last trained one, from the cache that sampled it."""
        import numpy as np

        from ..routes import routed_response_tokens

        rows, out = self.ended + self.rows, []
        for ep in eps:
            ctx = list(prompt) + ep.response_ids
            n = routed_response_tokens(ep.loss_mask)
            j = max((j for j, r in enumerate(rows) if ctx[:len(r.covered)] == r.covered
                     and len(r.covered) >= len(prompt) + n), key=lambda j: len(rows[j].covered))
            row = rows.pop(j)
            out.append(np.concatenate(row.routes, axis=0)[len(prompt):len(prompt) + n])
        return out

    def _turn(self, row: _Row, budget: int) -> TurnOutput:
        toks: list[int] = []
        lps: list[float] = []
        text, eos = "", False
        while len(toks) < budget:
            tok, lp = self.engine.pick(row.logits)
            toks.append(tok)
            lps.append(lp)
            if tok in self.eos:
                eos = True
                break
            if ">" in self.engine.decode([tok]):
                text = self.engine.decode(toks)
                if text.rstrip().endswith(STOP_STRINGS):
                    break
            if len(toks) < budget:  # feed the token only when another one will be drawn from it
                _feed(self.engine, row, [tok])
                row.covered.append(tok)
        return TurnOutput(toks, lps, self.engine.decode(toks), eos)


def sample_episode_group(engine: Engine, eos_ids: list[int], prompt: list[int], n: int, *, encode: Encode,
                         search: Search, max_new_tokens: int, max_turns: int = 4
                         ) -> tuple[list[Episode], PrefillCount]:
    """n search episodes of one prompt from one shared prefill; the generator's prefill counts. MoE models:
    each episode's `routes` and `prompt_routes` (the prompt's, recorded once for the group) are set."""
    gen = PrefixGenerator(engine, eos_ids)
    eps = run_episodes([list(prompt)] * n, gen, encode, search, max_new_tokens, max_turns)
    if getattr(gen, "prompt_routes", None) is not None:
        for ep, routes in zip(eps, gen.episode_routes(prompt, eps), strict=True):
            ep.routes, ep.prompt_routes = routes, gen.prompt_routes
    return eps, gen.count
