"""Multi-turn search episodes (PaperSearchQA) on either backend, through the task's one episode code.

Each group's prompt is prefilled once and its cache cloned into the n samples (`paged_prefix`); a turn's
samples decode together, one batched forward (`Engine.forward`) a step for those still going; a sample that
stops (`</search>`, `</answer>`, EOS, budget) leaves with its cache, and the next turn feeds every row its
tool turn in one ragged forward (`Engine.extend`; a prefill a row where the caches cannot): never re-prefilled.
Each sample draws from its own random stream, so `batched=False` (one at a time) draws the same tokens;
log-probs are those of the distribution drawn from. MoE models: every forward's routes go to the rows it fed.
`PrefillCount` counts prefill tokens both ways and forwards. More in docs/performance.md (Workers at full
speed) and docs/contract.md (the route recorder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..tasks.psqa import STOP_STRINGS, Encode, Episode, Search, TurnOutput, run_episodes


class Engine(Protocol):
    """What a backend gives the episode generator: batch-1 caches per sample, merged for decoding."""

    forwards: int
    """Model forward passes made (prefill chunks and batched decoding steps)."""

    def prefill(self, ids: list[int], state: Any | None) -> tuple[Any, Any]:
        """Feed ids into a batch-1 `state` (None: a fresh cache); (state, logits [1, vocab] of the last position)."""

    def clone(self, state: Any) -> Any:
        """An independent copy of a cache (later updates of either leave the other untouched)."""

    def streams(self, n: int) -> list[Any]:
        """n independent random streams, one per sample of a group."""

    def merge(self, states: list[Any], logits: list[Any]) -> tuple[Any, Any]:
        """Batch-1 caches and their last logits -> (one batched cache, logits [rows, vocab])."""

    def extend(self, states: list[Any], feeds: list[list[int]]) -> tuple[Any, Any] | None:
        """Batch-1 caches merged, row r then fed feeds[r] (the lengths differ) in as few forwards as memory
        allows: (batched cache, logits [rows, vocab] after each row's last id). None, having run nothing, where
        the caches cannot take rows of different lengths. A route recorder's take then gives [rows, longest,
        ...], row r's first len(feeds[r]) its own."""

    def forward(self, batch: Any, tokens: list[int]) -> Any:
        """Feed one token per row of `batch`; logits [rows, vocab]. The one place the model runs on a batch."""

    def extract(self, batch: Any, row: int) -> Any:
        """Row `row` of a batched cache as a batch-1 cache (a copy)."""

    def keep(self, batch: Any, rows: list[int]) -> Any:
        """The batched cache with only the given rows, in that order."""

    def pick(self, logits: Any, streams: list[Any]) -> tuple[list[int], list[float]]:
        """One token per row, row r drawn with streams[r]; (ids, log-probs under the distribution drawn from)."""

    def decode(self, ids: list[int]) -> str: ...

    def take_routes(self) -> Any | None:
        """MoE models: the routes of the forwards since the last take, uint8 [rows, tokens, layers, top_k] (a
        prefill: one row; a batched step: its rows in batch order); None for a dense model."""


@dataclass
class PrefillCount:
    """Prefill tokens and forward passes of one batch of groups."""

    extend: int = 0
    """Tokens fed outside decoding: each prompt once, then each sample's extensions after its tool turns."""
    reprefill: int = 0
    """What re-prefilling every turn's context from the start, per sample, would have fed."""
    turns: int = 0
    """Assistant turns sampled (all samples)."""
    forwards: int = 0
    """Model forward passes (prefills, extensions and batched decoding steps)."""
    extensions: int = 0
    """Of those, the forwards that fed the samples' tool turns (one a turn when fed together)."""


class _Row:
    """One sample's cache: the tokens it holds, the logits after them, its random stream; `routes` (MoE)
    cover `covered` token for token; `pending` is its last turn's last token, drawn but not fed; `feed` what
    the row must be fed before it decodes again (that token and its tool turn)."""

    __slots__ = ("sample", "covered", "state", "logits", "stream", "routes", "pending", "feed")

    def __init__(self, sample: int, covered: list[int], state: Any, logits: Any, stream: Any, routes: list):
        self.sample, self.covered, self.state, self.logits, self.stream = sample, covered, state, logits, stream
        self.routes = routes  # MoE: uint8 arrays [tokens, layers, top_k], concatenated they cover `covered`
        self.pending: int | None = None
        self.feed: list[int] = []


def _feed(engine: Engine, row: _Row, ids: list[int]) -> None:
    """Extend a row's batch-1 cache by ids; their routes, when the model records them, join the row's."""
    row.state, row.logits = engine.prefill(ids, row.state)
    row.covered += ids
    got = engine.take_routes()
    if got is not None:
        row.routes.append(got[0])


class PrefixGenerator:
    """`GenerateBatch` for run_episodes over per-sample caches that are extended, never rebuilt, and merged
    into one batch for each turn's decoding (`batched=False`: each sample decodes alone, the reference)."""

    def __init__(self, engine: Engine, eos_ids: list[int], *, batched: bool = True):
        self.engine, self.eos, self.batched = engine, set(eos_ids), batched
        self.rows: list[_Row] = []  # the last turn's rows, in the order of its contexts
        self.ended: list[_Row] = []  # rows of samples whose episodes ended
        self.prompt_routes: dict[tuple[int, ...], Any] = {}  # MoE: each distinct prompt's, recorded once
        self.count = PrefillCount()

    def _first_rows(self, contexts: list[list[int]]) -> list[_Row]:
        """Each distinct prompt prefilled once, its cache cloned into the rows of that prompt."""
        streams = self.engine.streams(len(contexts))
        seen: dict[tuple[int, ...], _Row] = {}
        rows = []
        for i, ctx in enumerate(contexts):
            key = tuple(ctx)
            if key not in seen:
                first = seen[key] = _Row(i, [], None, None, streams[i], [])
                _feed(self.engine, first, list(ctx))
                self.prompt_routes[key] = first.routes[0] if first.routes else None
                self.count.extend += len(ctx)
                rows.append(first)
            else:
                first = seen[key]
                rows.append(_Row(i, list(ctx), self.engine.clone(first.state), first.logits, streams[i],
                                 list(first.routes)))
        return rows

    def _follow(self, contexts: list[list[int]]) -> list[_Row]:
        """Each context's own row. run_episodes asks for the episodes still going in its episodes' order, each
        context that episode's last one, the turn it was given and its tool turn; so each context takes the
        next row (in the last turn's order) whose whole turn it extends, and a row passed over is of an
        episode that ended. Samples holding the same tokens keep their order: one never takes another's row."""
        rows, last = [], iter(self.rows)
        for ctx in contexts:
            for row in last:
                turn = row.covered + [row.pending]
                if ctx[:len(turn)] == turn:
                    rows.append(row)
                    break
                self.ended.append(row)
            else:
                raise AssertionError("a context that extends no sample's turn")
        self.ended.extend(last)
        for row, ctx in zip(rows, contexts, strict=True):  # its last token and its tool turn: fed by `_start`
            row.feed = ctx[len(row.covered):]
            self.count.extend += len(row.feed)
        return rows

    def __call__(self, contexts: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        before = self.engine.forwards
        rows = self._first_rows(contexts) if not self.rows and not self.ended else self._follow(contexts)
        self.count.reprefill += sum(len(c) for c in contexts)
        self.count.turns += len(contexts)
        if self.batched:
            outs = self._decode(rows, budgets)
        else:
            outs = [self._decode([row], [budget])[0] for row, budget in zip(rows, budgets, strict=True)]
        self.rows = rows
        self.count.forwards += self.engine.forwards - before
        return outs

    def _stops(self, toks: list[int], budget: int) -> tuple[bool, bool]:
        """(turn over, ended on EOS) after the token just drawn."""
        if toks[-1] in self.eos:
            return True, True
        if ">" in self.engine.decode(toks[-1:]) and self.engine.decode(toks).rstrip().endswith(STOP_STRINGS):
            return True, False
        return len(toks) >= budget, False

    def _decode(self, rows: list[_Row], budgets: list[int]) -> list[TurnOutput]:
        """One turn of every row, decoded together: one batched forward per step for the rows still going; a
        row that stops leaves the batch with its cache (its last token not fed: the next turn's extension
        feeds it), so no row ever sees another's tokens. A step's routes go to its rows in batch order."""
        eng = self.engine
        toks: list[list[int]] = [[] for _ in rows]
        lps: list[list[float]] = [[] for _ in rows]
        eos = [False] * len(rows)
        live = list(range(len(rows)))
        batch, logits = self._start(rows)
        while live:
            drawn, probs = eng.pick(logits, [rows[i].stream for i in live])
            going = []
            for j, (i, t, lp) in enumerate(zip(live, drawn, probs, strict=True)):
                toks[i].append(t)
                lps[i].append(lp)
                over, eos[i] = self._stops(toks[i], budgets[i])
                if over:
                    rows[i].state, rows[i].pending = eng.extract(batch, j), t
                else:
                    going.append(j)
            if not going:
                break
            if len(going) < len(live):
                batch = eng.keep(batch, going)
            live = [live[j] for j in going]
            fed = [drawn[j] for j in going]
            for i, t in zip(live, fed, strict=True):
                rows[i].covered.append(t)
            logits = eng.forward(batch, fed)
            got = eng.take_routes()
            if got is not None:
                assert len(got) == len(live), "a step's routes of other rows than it fed"
                for j, i in enumerate(live):
                    rows[i].routes.append(got[j])
        return [TurnOutput(toks[i], lps[i], eng.decode(toks[i]), eos[i]) for i in range(len(rows))]

    def _start(self, rows: list[_Row]) -> tuple[Any, Any]:
        """The turn's batch and logits: the rows' caches merged, each first fed what its tool turn added, all
        in one ragged pass where the engine can (a lone row, or caches that cannot: a prefill a row)."""
        eng, before = self.engine, self.engine.forwards
        got = eng.extend([r.state for r in rows], [r.feed for r in rows]) if rows[0].feed and len(rows) > 1 \
            else None
        if got is not None:
            routes = eng.take_routes()
            for j, row in enumerate(rows):
                row.covered += row.feed
                if routes is not None:
                    row.routes.append(routes[j, :len(row.feed)])
        else:
            for row in rows:
                if row.feed:
                    _feed(eng, row, row.feed)
            got = eng.merge([r.state for r in rows], [r.logits for r in rows])
        self.count.extensions += eng.forwards - before
        for row in rows:
            row.feed = []
        return got

    def attach_routes(self, prompts: list[list[int]], eps: list[Episode]) -> None:
        """MoE models: each episode's `routes`, as the record carries them (worker_contract/routes.py: the
        response tokens before its last trained one), from its own row, and its prompt's `prompt_routes`."""
        import numpy as np

        from ..routes import routed_response_tokens

        rows = {row.sample: row for row in self.ended + self.rows}
        for i, (prompt, ep) in enumerate(zip(prompts, eps, strict=True)):
            row, n = rows[i], routed_response_tokens(ep.loss_mask)
            held = np.concatenate(row.routes, axis=0)
            assert len(held) == len(row.covered), "routes that do not cover the row's tokens one for one"
            assert row.covered == (list(prompt) + ep.response_ids)[:len(row.covered)], "a row of another sample"
            assert len(row.covered) >= len(prompt) + n, "a routed token the row never fed"
            ep.routes, ep.prompt_routes = held[len(prompt):len(prompt) + n], self.prompt_routes[tuple(prompt)]


def sample_episode_groups(engine: Engine, eos_ids: list[int], prompts: list[list[int]], n: int, *,
                          encode: Encode, search: Search, max_new_tokens: int, max_turns: int = 4,
                          batched: bool = True) -> tuple[list[list[Episode]], PrefillCount]:
    """n search episodes of each prompt, every group's samples decoding in one batch; (groups, counts). MoE
    models: each episode's `routes` and `prompt_routes` (its prompt's, recorded once for the group) are set."""
    gen = PrefixGenerator(engine, eos_ids, batched=batched)
    flat_prompts = [list(p) for p in prompts for _ in range(n)]
    flat = run_episodes(flat_prompts, gen, encode, search, max_new_tokens, max_turns)
    if any(r is not None for r in gen.prompt_routes.values()):
        gen.attach_routes(flat_prompts, flat)
    return [flat[g * n:(g + 1) * n] for g in range(len(prompts))], gen.count


def sample_episode_group(engine: Engine, eos_ids: list[int], prompt: list[int], n: int, *, encode: Encode,
                         search: Search, max_new_tokens: int, max_turns: int = 4, batched: bool = True
                         ) -> tuple[list[Episode], PrefillCount]:
    """n search episodes of one prompt from one shared prefill; the generator's counts."""
    groups, count = sample_episode_groups(engine, eos_ids, [prompt], n, encode=encode, search=search,
                                          max_new_tokens=max_new_tokens, max_turns=max_turns, batched=batched)
    return groups[0], count
