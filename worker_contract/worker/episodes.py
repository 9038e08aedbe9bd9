"""Multi-turn search episodes (PaperSearchQA) on either backend, through the task's one episode code.

Each group's prompt is prefilled once and its cache cloned into the n samples (`paged_prefix`); a turn's
samples decode together, their caches merged into one batch, one batched forward (`Engine.forward`) a step
for the samples still going; a sample that stops (`</search>`, `</answer>`, EOS, budget) leaves with its
cache, which its tool turn extends before it rejoins at the next turn (never re-prefilled). Each sample
draws from its own random stream, so `batched=False` (one at a time) draws the same tokens; log-probs are
those of the distribution drawn from. `PrefillCount` counts prefill tokens both ways and forwards.
More in docs/performance.md (Workers at full speed).
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

    def forward(self, batch: Any, tokens: list[int]) -> Any:
        """Feed one token per row of `batch`; logits [rows, vocab]. The one place the model runs on a batch."""

    def extract(self, batch: Any, row: int) -> Any:
        """Row `row` of a batched cache as a batch-1 cache (a copy)."""

    def keep(self, batch: Any, rows: list[int]) -> Any:
        """The batched cache with only the given rows, in that order."""

    def pick(self, logits: Any, streams: list[Any]) -> tuple[list[int], list[float]]:
        """One token per row, row r drawn with streams[r]; (ids, log-probs under the distribution drawn from)."""

    def decode(self, ids: list[int]) -> str: ...


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


class _Row:
    __slots__ = ("covered", "state", "logits", "stream")

    def __init__(self, covered: list[int], state: Any, logits: Any, stream: Any):
        self.covered, self.state, self.logits, self.stream = covered, state, logits, stream


class PrefixGenerator:
    """`GenerateBatch` for run_episodes over per-sample caches that are extended, never rebuilt, and merged
    into one batch for each turn's decoding (`batched=False`: each sample decodes alone, the reference)."""

    def __init__(self, engine: Engine, eos_ids: list[int], *, batched: bool = True):
        self.engine, self.eos, self.batched = engine, set(eos_ids), batched
        self.rows: list[_Row] = []
        self.count = PrefillCount()

    def _row_for(self, ctx: list[int]) -> _Row:
        """The cache holding the longest prefix of `ctx` (any cache of a prefix is valid for it: a cache is
        what its tokens make it), extended by the rest; taken, so no two contexts share one."""
        fits = [j for j, row in enumerate(self.rows)
                if len(row.covered) <= len(ctx) and ctx[:len(row.covered)] == row.covered]
        assert fits, "a context that extends no sample's cache"
        row = self.rows.pop(max(fits, key=lambda j: len(self.rows[j].covered)))
        if len(ctx) > len(row.covered):
            row.state, row.logits = self.engine.prefill(ctx[len(row.covered):], row.state)
            self.count.extend += len(ctx) - len(row.covered)
            row.covered = list(ctx)
        return row

    def _first_rows(self, contexts: list[list[int]]) -> None:
        """Each distinct prompt prefilled once, its cache cloned into the rows of that prompt."""
        streams = self.engine.streams(len(contexts))
        seen: dict[tuple[int, ...], tuple[Any, Any]] = {}
        for i, ctx in enumerate(contexts):
            key = tuple(ctx)
            if key not in seen:
                seen[key] = self.engine.prefill(ctx, None)
                self.count.extend += len(ctx)
                state, logits = seen[key]
            else:
                state, logits = self.engine.clone(seen[key][0]), seen[key][1]
            self.rows.append(_Row(list(ctx), state, logits, streams[i]))

    def __call__(self, contexts: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        before = self.engine.forwards
        if not self.rows:
            self._first_rows(contexts)
        rows = [self._row_for(c) for c in contexts]
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
        feeds it), so no row ever sees another's tokens."""
        eng = self.engine
        toks: list[list[int]] = [[] for _ in rows]
        lps: list[list[float]] = [[] for _ in rows]
        eos = [False] * len(rows)
        live = list(range(len(rows)))
        batch, logits = eng.merge([r.state for r in rows], [r.logits for r in rows])
        while live:
            drawn, probs = eng.pick(logits, [rows[i].stream for i in live])
            going = []
            for j, (i, t, lp) in enumerate(zip(live, drawn, probs, strict=True)):
                toks[i].append(t)
                lps[i].append(lp)
                over, eos[i] = self._stops(toks[i], budgets[i])
                if over:
                    rows[i].state = eng.extract(batch, j)
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
        return [TurnOutput(toks[i], lps[i], eng.decode(toks[i]), eos[i]) for i in range(len(rows))]


def sample_episode_groups(engine: Engine, eos_ids: list[int], prompts: list[list[int]], n: int, *,
                          encode: Encode, search: Search, max_new_tokens: int, max_turns: int = 4,
                          batched: bool = True) -> tuple[list[list[Episode]], PrefillCount]:
    """n search episodes of each prompt, every group's samples decoding in one batch; (groups, counts)."""
    gen = PrefixGenerator(engine, eos_ids, batched=batched)
    flat = run_episodes([list(p) for p in prompts for _ in range(n)], gen, encode, search, max_new_tokens, max_turns)
    return [flat[g * n:(g + 1) * n] for g in range(len(prompts))], gen.count


def sample_episode_group(engine: Engine, eos_ids: list[int], prompt: list[int], n: int, *, encode: Encode,
                         search: Search, max_new_tokens: int, max_turns: int = 4, batched: bool = True
                         ) -> tuple[list[Episode], PrefillCount]:
    """n search episodes of one prompt from one shared prefill; the generator's counts."""
    groups, count = sample_episode_groups(engine, eos_ids, [prompt], n, encode=encode, search=search,
                                          max_new_tokens=max_new_tokens, max_turns=max_turns, batched=batched)
    return groups[0], count
