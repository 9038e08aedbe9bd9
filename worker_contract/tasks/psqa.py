"""PaperSearchQA: biomedical factoid questions answered by searching a corpus of paper abstracts.

Episodes are multi-turn (`<search>` turns answered by the retriever's documents as tool tokens with loss
mask 0, ending in `<answer>`), assembled at the token-id level so the recorded log-probs are exactly those
the worker sampled. The reward is cover-EM on whole normalized words; the data is `jmhb/PaperSearchQA`.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field

from ..schema import Sample
from .base import CachedSplitTask, LazySplit, Problem, Split, hf_datasets, local_split_path

HF_DATASET = "jmhb/PaperSearchQA"
HF_CORPUS = "jmhb/pubmed_bioasq_2022"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
#: the generator must stop right after either of these (or at EOS)
STOP_STRINGS = (SEARCH_CLOSE, ANSWER_CLOSE)

INSTRUCTION = (
    "Answer the question below. Reason inside <think> and </think> each time you receive new "
    "information. When you need facts you do not have, search a corpus of biomedical paper abstracts by "
    "writing <search> your query </search>; the top results come back between <information> and "
    "</information>. Search as often as you need. When you are sure, write only the short final answer "
    "inside <answer> and </answer>, for example <answer> dystrophin </answer>."
)

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL | re.IGNORECASE)
_INFO_RE = re.compile(r"<information>.*?</information>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


class PsqaProblem(Problem):
    """A PaperSearchQA question with every accepted spelling of its answer."""

    golden_answers: tuple[str, ...] = Field(min_length=1)
    """Accepted answers (synonyms, abbreviations); `answer` is the first."""
    pmid: str | None = None
    """PubMed id of the abstract the question was written from."""
    category: str | None = None
    """Topic category of the question (one of ten biomedical categories)."""


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def cover_em(prediction: str | None, golden_answers: Sequence[str]) -> float:
    """1.0 if some normalized gold answer appears, as whole words, in the normalized prediction."""
    if prediction is None:
        return 0.0
    pred = f" {normalize_answer(prediction)} "
    for gold in golden_answers:
        g = normalize_answer(str(gold))
        if g and f" {g} " in pred:
            return 1.0
    return 0.0


def extract_answer(completion: str) -> str | None:
    """The last `<answer>` of the model's own text (retrieved documents are ignored), or None."""
    found = _ANSWER_RE.findall(_INFO_RE.sub(" ", completion))
    return found[-1].strip() if found else None


def parse_search(turn_text: str) -> str | None:
    """The query of a turn that ends in `</search>`, or None when the turn does not call the tool."""
    if not turn_text.rstrip().endswith(SEARCH_CLOSE):
        return None
    found = _SEARCH_RE.findall(turn_text)
    query = found[-1].strip() if found else ""
    return query or None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: n samples, c of them correct (1 - C(n-c, k) / C(n, k))."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def tool_turn_text(documents: str) -> str:
    return f"\n\n{INFO_OPEN}{documents}{INFO_CLOSE}\n\n"


class TurnOutput(NamedTuple):
    """What a generator returns for one assistant turn."""

    token_ids: list[int]
    """Sampled token ids (EOS included when the turn ended on it)."""
    logprobs: list[float]
    """Log-prob of each sampled token at the run's temperature."""
    text: str
    """Decoded text of the turn."""
    eos: bool
    """True when the turn ended on the end-of-sequence token."""


#: (context ids, token budget) -> the next assistant turn, stopped after a STOP_STRING or at EOS
Generate = Callable[[list[int], int], TurnOutput]
#: (contexts, budgets) -> one turn per context, same contract as Generate
GenerateBatch = Callable[[list[list[int]], list[int]], list[TurnOutput]]
#: text -> token ids, no special tokens added
Encode = Callable[[str], list[int]]
#: query -> formatted documents (infra retriever, a local index, ...)
Search = Callable[[str], str]


@dataclass
class Episode:
    """One multi-turn completion with its per-token loss mask."""

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    searches: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    routes: Any = None
    """MoE models: the response tokens' routes as the record carries them (worker_contract/routes.py)."""
    prompt_routes: Any = None
    """MoE models: the prompt's routes, recorded once for the group."""

    def _append(self, ids: list[int], lps: list[float] | None, text: str) -> None:
        trainable = lps is not None
        assert lps is None or len(lps) == len(ids), "one log-prob per sampled token"
        self.response_ids += ids
        self.loss_mask += [1 if trainable else 0] * len(ids)
        self.behavior_logprobs += list(lps) if trainable else [0.0] * len(ids)
        self.text += text

    def to_sample(self, reward: float) -> Sample:
        return Sample(response_ids=self.response_ids, behavior_logprobs=self.behavior_logprobs,
                      loss_mask=self.loss_mask, reward=reward, finish_reason=self.finish_reason)  # type: ignore[arg-type]


def _advance(ep: Episode, out: TurnOutput, max_new_tokens: int, max_turns: int, encode: Encode,
             search: Search) -> bool:
    """Apply one sampled turn (and its tool turn) to `ep`; True while the episode goes on."""
    budget = max_new_tokens - len(ep.response_ids)
    ep._append(list(out.token_ids[:budget]), list(out.logprobs[:budget]), out.text)
    query = None if out.eos else parse_search(out.text)
    if query is None:  # 'stop' when the turn ended at EOS or `</answer>` (a bare one too), else the budget ended it
        done = out.eos or extract_answer(out.text) is not None or out.text.rstrip().endswith(ANSWER_CLOSE)
        ep.finish_reason = "stop" if done else "length"
        return False
    ep.searches.append(query)
    if len(ep.searches) > max_turns:
        ep.finish_reason = "tool"
        return False
    room = max_new_tokens - len(ep.response_ids)
    if room <= 0:  # no budget left for the documents: no call to the tool
        ep.finish_reason = "length"
        return False
    tool_text = tool_turn_text(search(query))
    tool_ids = encode(tool_text)
    ep._append(tool_ids[:room], None, tool_text)
    if len(tool_ids) >= room:
        ep.finish_reason = "length"
        return False
    return True


def run_episodes(prompts: list[list[int]], generate_batch: GenerateBatch, encode: Encode, search: Search,
                 max_new_tokens: int, max_turns: int = 4) -> list[Episode]:
    """Drive several search episodes in lockstep (one batched generate call per turn). `max_turns` bounds
    tool calls; finish_reason is 'stop' (answer or EOS), 'length' (budget spent) or 'tool' (still
    searching when the turns ran out)."""
    eps = [Episode() for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        budgets = [max_new_tokens - len(eps[i].response_ids) for i in active]
        outs = generate_batch([prompts[i] + eps[i].response_ids for i in active], budgets)
        assert len(outs) == len(active), "one turn per context"
        active = [i for i, out in zip(active, outs, strict=True)
                  if _advance(eps[i], out, max_new_tokens, max_turns, encode, search)]
    return eps


def run_episode(prompt_ids: list[int], generate: Generate, encode: Encode, search: Search,
                max_new_tokens: int, max_turns: int = 4) -> Episode:
    """One episode with a one-sequence generator (see `run_episodes`)."""
    batch = lambda ctxs, budgets: [generate(c, b) for c, b in zip(ctxs, budgets, strict=True)]  # noqa: E731
    return run_episodes([prompt_ids], batch, encode, search, max_new_tokens, max_turns)[0]


def _golden(row: dict) -> tuple[str, ...]:
    gold = row.get("golden_answers")
    if isinstance(gold, str):
        try:
            gold = json.loads(gold)
        except ValueError:
            gold = [gold]
    answers = [str(a) for a in (gold or []) if str(a).strip()]
    if row.get("answer") and str(row["answer"]) not in answers:
        answers.insert(0, str(row["answer"]))
    if not answers:
        raise ValueError(f"a PaperSearchQA row needs 'answer' or 'golden_answers'; got keys {sorted(row)}")
    return tuple(answers)


def problem_from_row(split: str, index: int, row: dict) -> PsqaProblem:
    if not str(row.get("question", "")).strip():
        raise ValueError(f"PaperSearchQA {split} row {index} has no 'question'")
    gold = _golden(row)
    pmid = row.get("pmid")
    return PsqaProblem(id=f"psqa-{split}-{index}", question=str(row["question"]).strip(), answer=gold[0],
                       golden_answers=gold, pmid=None if pmid in (None, "") else str(pmid),
                       category=row.get("category"))


def load_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_psqa(split: Split, local_dir: str | None = None, revision: str | None = None) -> list[dict]:
    """The real split: from `local_dir`/$DRL_PSQA_DIR when set, else `datasets` (downloads once)."""
    path = local_split_path(split, local_dir, "DRL_PSQA_DIR", "PaperSearchQA")
    if path is not None:
        return load_jsonl(path)
    datasets = hf_datasets("PaperSearchQA", HF_DATASET, "DRL_PSQA_DIR")
    ds = datasets.load_dataset(HF_DATASET, split=split, revision=revision or os.environ.get("DRL_PSQA_REVISION"))
    return [dict(row) for row in ds]


class PsqaTask(CachedSplitTask):
    """PaperSearchQA prompt, answer extraction and cover-EM reward; episodes via `run_episode`."""

    name = "psqa"
    multi_turn = True
    services = ("retriever",)
    heldout_label = "held-out cover-EM"

    def batch_metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The share of samples that searched (a tool turn is a mask-0 span), and of the correct ones, the
        share found after a search."""
        searched = [0 in s.loss_mask for s in samples]
        right = [s.reward >= 1.0 for s in samples]
        return {"rollout/search_rate": sum(searched) / max(len(samples), 1),
                "rollout/correct_after_search": (sum(a and b for a, b in zip(right, searched, strict=True))
                                                 / sum(right)) if any(right) else 0.0}

    def _load_split(self, split: Split) -> Sequence[PsqaProblem]:
        rows = load_psqa(split, self.local_dir)
        return LazySplit(split, len(rows), lambda i: problem_from_row(split, i, rows[i]))

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        question = problem.question.strip()
        return [{"role": "user", "content": f"{INSTRUCTION}\nQuestion: {question}"}]

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def reward(self, completion: str, problem: Problem) -> float:
        gold = getattr(problem, "golden_answers", None) or (problem.answer,)
        return cover_em(self.extract_answer(completion), gold)
