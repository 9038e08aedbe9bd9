"""GSM8K: grade-school math word problems whose solutions end in `#### <number>`.

Prompt: one user message, the question followed by an instruction to put the final answer after `####`.
Answer extraction: the number after the first `####` if there is one, else the last number in the text.
Numbers may carry thousands separators (1,234), a sign (-3, +3, the Unicode minus), decimals (2.50),
a currency sign ($18) or a trailing unit (18 dollars, 12 cm, 50%): all of these compare by value.
Reward: 1.0 when the extracted answer equals the gold answer, else 0.0. There is no format bonus: every
scored completion is already asked for the `####` form, and a bonus would pay a policy for confident
wrong answers, which is the opposite of what the run trains.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .base import CachedSplitTask, LazySplit, Problem, Split, hf_datasets, local_split_path

HF_DATASET = "openai/gsm8k"
HF_CONFIG = "main"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# A number as written in a solution: optional sign and currency sign, digits with optional thousands
# groups, optional decimals (or a bare decimal like .5). Python's re has no number grammar, so we write one.
# A sign counts only when it is not an operator (not right after a word, digit or bracket: "12-5" is 12, 5).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])(?P<sign>[-+\u2212]))?\$?"
    r"(?P<num>(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+))"
)
_MARKER = "####"


def canonical_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '-0' -> '0', '18.00' -> '18'; None when `text` is not one number."""
    m = _NUMBER.fullmatch(text.strip())
    if not m:
        return None
    return _canon(m)


def _canon(m: re.Match[str]) -> str | None:
    try:
        value = Decimal(m.group("num").replace(",", ""))
    except InvalidOperation:
        return None
    if m.group("sign") in ("-", "\u2212"):
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(completion: str) -> str | None:
    """The number after the first `####`, else the last number anywhere; canonical form, or None."""
    idx = completion.find(_MARKER)
    if idx >= 0:
        line = completion[idx + len(_MARKER):].split("\n", 1)[0]
        m = _NUMBER.search(line)
        if m:
            return _canon(m)
    last = None
    for m in _NUMBER.finditer(completion):
        last = m
    return _canon(last) if last else None


def answers_match(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    gold_c = canonical_number(gold)
    if gold_c is None:
        return predicted.strip() == gold.strip()
    return Decimal(predicted) == Decimal(gold_c)


def gold_answer(solution: str) -> str:
    """The canonical answer of a GSM8K reference solution (the text after its `####`)."""
    if _MARKER not in solution:
        raise ValueError(f"a GSM8K solution ends in '#### <answer>'; got {solution[-60:]!r}")
    answer = canonical_number(solution.rsplit(_MARKER, 1)[1])
    if answer is None:
        raise ValueError(f"GSM8K solution's final answer is not a number: {solution[-60:]!r}")
    return answer


def prompt_text(question: str) -> str:
    return f"{question.strip()}\n{INSTRUCTION}"


def load_jsonl(path: str | Path) -> list[tuple[str, str]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                obj = json.loads(line)
                if "question" not in obj or "answer" not in obj:
                    raise ValueError(f"{path}:{n}: a GSM8K row needs 'question' and 'answer'")
                rows.append((obj["question"], obj["answer"]))
    return rows


def load_gsm8k(split: Split, local_dir: str | None = None) -> list[tuple[str, str]]:
    """The real GSM8K split: from `local_dir`/$DRL_GSM8K_DIR if set, else `datasets` (downloads once)."""
    path = local_split_path(split, local_dir, "DRL_GSM8K_DIR", "GSM8K")
    if path is not None:
        return load_jsonl(path)
    datasets = hf_datasets("GSM8K", HF_DATASET, "DRL_GSM8K_DIR")
    ds = datasets.load_dataset(HF_DATASET, HF_CONFIG, split=split)
    return [(row["question"], row["answer"]) for row in ds]


class GSM8KTask(CachedSplitTask):
    """GSM8K prompt format, extraction and reward over the real data set."""

    name = "gsm8k"

    def _load_split(self, split: Split) -> Sequence[Problem]:
        rows = load_gsm8k(split, self.local_dir)

        def make(i: int) -> Problem:  # ids `gsm8k-<split>-<index>`
            q, sol = rows[i]
            return Problem(id=f"gsm8k-{split}-{i}", question=q, answer=gold_answer(sol), solution=sol)

        return LazySplit(split, len(rows), make)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": prompt_text(problem.question)}]

    def stand_in(self) -> str | None:
        """`arithmetic` (generated problems in GSM8K's format) where the real set cannot be loaded here: no
        local copy (DRL_GSM8K_DIR) and no `datasets` package to fetch it."""
        local = self.local_dir or os.environ.get("DRL_GSM8K_DIR")
        if local:
            return None if (Path(local) / "train.jsonl").exists() else "arithmetic"
        try:
            import datasets  # noqa: F401
        except ImportError:
            return "arithmetic"
        return None

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if answers_match(self.extract_answer(completion), problem.answer) else 0.0
